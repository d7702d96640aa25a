"""A tiny random-weight Llama and a character-level tokenizer, built locally (no hub, no download).

Why this shape:

* **float32 weights.** Greedy text is then an exact oracle in practice: prefilling from pulled KV,
  from a local prefix cache or from scratch differs by float32 rounding (~1e-7 relative), far
  below the logit gaps of a random model, whereas bf16 flips near-tied tokens between cached and
  full prefill (``../shared/PITFALLS.md``).
* **One character = one token, and decoding is lossless.** The tokenizer is a BPE without merges
  over printable ASCII and newline with a ``Fuse`` decoder, and the chat markers are added tokens
  (``<|im_start|>`` is not "special", so it survives detokenization). Whatever the random model
  generates, detokenize -> retokenize gives back the same ids, so D's retained sequence is exactly
  the token prefix of the next turn's prompt -- the condition under which reusing D's KV is right.
  ``<|im_end|>`` is the EOS token.
* **Tiny** (2 layers, hidden 64, head_dim 32 -- the smallest vLLM's CPU attention takes): a prefill of a few hundred tokens costs milliseconds on CPU, so the
  servers' time goes to vLLM itself, not to the model.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IM_START, IM_END, UNK = "<|im_start|>", "<|im_end|>", "<unk>"


def _vocab() -> dict[str, int]:
    vocab = {IM_START: 0, IM_END: 1, UNK: 2}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    return vocab


def build_tokenizer(out: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json into ``out``; returns the vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = _vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(IM_START, special=False, normalized=False)])
    tok.add_special_tokens([AddedToken(IM_END, special=True, normalized=False),
                            AddedToken(UNK, special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "unk_token": UNK,
        "pad_token": IM_END,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": IM_END, "unk_token": UNK,
                                                             "pad_token": IM_END}))
    return len(vocab)


def build_tiny_model(out: Path, seed: int = 1234, max_position_embeddings: int = 4096, hidden_size: int = 64,
                     num_hidden_layers: int = 2) -> Path:
    """Build (idempotently) the model directory ``out`` and return it. The defaults make the tests'
    model; measurement scripts ask for a wider, deeper one so that recomputing a prompt costs
    something measurable on a CPU."""
    out = Path(out)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=hidden_size // 16,
        num_key_value_heads=max(hidden_size // 32, 1),
        head_dim=32,  # the smallest vLLM's CPU attention takes
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # wider weights than the default init: sharper logits, fewer near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 1}))
    return out


if __name__ == "__main__":  # python -m tests.e2e.tiny_model /tmp/tiny
    import sys

    print(build_tiny_model(Path(sys.argv[1])))
