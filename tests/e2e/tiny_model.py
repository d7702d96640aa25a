"""A tiny random-weight Llama and a byte-level BPE tokenizer with merges, built locally (no hub, no download).

Why this shape:

* **float32 weights.** Greedy text is then an exact oracle in practice: prefilling from pulled KV,
  from a local prefix cache or from scratch differs by float32 rounding (~1e-7 relative), far
  below the logit gaps of a random model, whereas bf16 flips near-tied tokens between cached and
  full prefill.
* **A real tokenizer: byte-level BPE with merges**, trained here on generated English-like text
  (GPT-2's scheme: byte alphabet, ``ByteLevel`` pre-tokenizer and decoder). Detokenize ->
  retokenize is then *not* the identity: the model's generated split is often not the canonical
  one, so the next turn's prompt holds other ids than the KV D kept -- the condition the connector's
  token-exact verification (impl/policy/prefix_check.py) exists for. (An earlier version of this
  suite used one character per token, under which retokenization is lossless and a wrong pull is
  invisible.)
* **A chat template with the variants real ones have**, chosen per request with
  ``chat_template_kwargs``: plain (ChatML); ``trim`` renders assistant content ``| trim`` as
  Llama 3's template does; ``think`` opens every answer with ``<think>\n`` in the generation prompt
  and renders earlier answers with their reasoning stripped, as Qwen3's and DeepSeek-R1's do.
* **Tiny** (2 layers, hidden 64, head_dim 32 -- the smallest vLLM's CPU attention takes): a prefill
  of a few hundred tokens costs milliseconds on CPU, so the servers' time goes to vLLM itself.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and trim %}{{ m['content'] | trim }}"
    "{% elif m['role'] == 'assistant' and think %}{{ m['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{% endif %}"
)
IM_START, IM_END, THINK_OPEN, THINK_CLOSE = "<|im_start|>", "<|im_end|>", "<think>", "</think>"
# ids 0..3 in that order; the test client bans <|im_end|> (EOS) and the think markers, so every answer
# has exactly max_tokens tokens and the markers appear only where the template puts them
SPECIAL_IDS = {IM_START: 0, IM_END: 1, THINK_OPEN: 2, THINK_CLOSE: 3}
FIRST_ORDINARY_ID = len(SPECIAL_IDS)
VOCAB_SIZE = 512

_WORDS = ("the a of and to in is it that was for on are with as his they be at one have this from or had by hot "
          "word but what some we can out other were all there when up use your how said an each she which do "
          "their time if will way about many then them write would like so these her long make thing see him "
          "two has look more day could go come did number sound no most people my over know water than call "
          "first who may down side been now find bicycle history detail gears chains brakes work lighthouse "
          "keeper hour night planets fact largest rivers flow longest tides moon volcanoes magma steam engine "
          "condenser refrigerator food cold hum warm handshake again tell me thanks explain step describe list "
          "name three why does assistant helpful you please").split()


def _corpus(seed: int = 0, sentences: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        sentence = " ".join(words).capitalize() + rng.choice(".?!,;:") + rng.choice(("", " ", "\n", "\n\n"))
        if rng.random() < 0.1:
            sentence += f"[{rng.randint(0, 9999)}-{rng.getrandbits(32):08x}] "
        out.append(sentence)
    return out


@functools.cache
def _trained():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_IDS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # the chat markers stay in detokenized text (not "special"), except the EOS
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (IM_START, THINK_OPEN, THINK_CLOSE)])
    tok.add_special_tokens([AddedToken(IM_END, special=True, normalized=False)])
    vocab = tok.get_vocab()
    assert all(vocab[t] == i for t, i in SPECIAL_IDS.items()), "the trainer placed the special tokens elsewhere"
    assert json.loads(tok.to_str())["model"]["merges"], "no merges learned"
    return tok


@functools.cache
def generation_logit_bias() -> dict[str, int]:
    """The test client's ``logit_bias``: no EOS, no think markers, and no token outside printable ASCII.

    A random model otherwise emits lone bytes of multi-byte UTF-8 characters and control bytes, which
    detokenize to U+FFFD and re-tokenize as something else entirely at the answer's first token; with
    them banned, what still differs is the BPE split itself (a few tokens in), as with a trained model.
    """
    tok = _trained()
    banned = {str(i): -100 for i in (1, 2, 3)}
    for token_id in range(FIRST_ORDINARY_ID, tok.get_vocab_size()):
        text = tok.decode([token_id])
        if not text or any(not (32 <= ord(c) < 127 or c == "\n") for c in text):
            banned[str(token_id)] = -100
    return banned


def build_tokenizer(out: Path) -> int:
    """Write the trained tokenizer (tokenizer.json + tokenizer_config.json) into ``out``; returns its size."""
    tok = _trained()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": IM_END,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": IM_END, "pad_token": IM_END}))
    return tok.get_vocab_size()


def kv_bytes_per_token(hidden_size: int = 64, num_hidden_layers: int = 2) -> int:
    """KV bytes per token of :func:`build_tiny_model`'s model: K and V, every layer, float32, its kv heads
    (hidden // 32) x head_dim 32."""
    return num_hidden_layers * 2 * max(hidden_size // 32, 1) * 32 * 4


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
