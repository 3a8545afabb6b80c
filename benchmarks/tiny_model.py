"""A tiny Qwen3 model and tokenizer built on the fly (tests and the trainer benchmark): no download, CPU-sized, real TRL parsing.

- The tokenizer is a byte-level BPE trained with ``tokenizers`` on a small
  corpus (every byte stays encodable), wrapped as a ``PreTrainedTokenizerFast``
  carrying TRL's own Qwen3 chat template (``trl/chat_templates/qwen3.jinja``).
  TRL recognises a chat template by exact string equality, so its
  ``add_response_schema`` applies and tool calls written as ``<tool_call>``
  JSON are parsed exactly as for a real Qwen3.
- The model is a ``Qwen3ForCausalLM`` with random weights (2 layers, hidden 32).
- Both are saved to a folder whose path is passed as ``model=``, the loading
  path a real run uses.

Generation is meant to be patched (``trainer.model.generate``), as in TRL's own
tests: see :func:`encode_exact`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AddedToken,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

#: TRL's Qwen3 template, byte for byte (TRL matches templates by equality).
QWEN3_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")

# Qwen3's split: these three are special tokens; the tool and think markers are
# added tokens that are not special, so decode(skip_special_tokens=True) keeps them.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_NON_SPECIAL = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_BASE_CORPUS = [
    QWEN3_TEMPLATE,
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>',
    (
        '{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", '
        '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}'
    ),
    "You may call one or more functions to assist with the user query. system user assistant tool",
    "pwd ls cat head printf echo /workdir/answer.txt the quick brown fox 0123456789 Done.",
]


def build_tokenizer(out_dir: Path, corpus: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Train, save and reload the tokenizer; ``corpus`` adds texts the merges should favour."""
    texts = (_BASE_CORPUS + list(corpus)) * 4
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        min_frequency=1,
        special_tokens=SPECIAL,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_NON_SPECIAL])
    hf_tok.chat_template = QWEN3_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    # Reload from disk as the trainer will, and check what TRL relies on survived.
    loaded = AutoTokenizer.from_pretrained(out_dir)
    if loaded.chat_template != QWEN3_TEMPLATE:
        raise AssertionError("chat template changed on save/load; TRL would not recognise it")
    for token in SPECIAL + ADDED_NON_SPECIAL:
        if len(loaded.encode(token, add_special_tokens=False)) != 1:
            raise AssertionError(f"{token!r} is not a single token")
    return loaded


def build_model(out_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save a randomly initialised 2-layer Qwen3 sized for ``tokenizer``."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out_dir)


def build_tiny_qwen3(out_dir: Path, corpus: Iterable[str] = ()) -> tuple[Path, PreTrainedTokenizerFast]:
    """Build tokenizer and model into ``out_dir``; return the folder (for ``model=``) and the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, corpus)
    build_model(out_dir, tokenizer)
    return out_dir, tokenizer


def encode_exact(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids for ``text`` that decode back to exactly ``text`` (what a patched ``generate`` emits)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(ids) != text:
        raise AssertionError(f"text does not round-trip through the tokenizer: {text!r}")
    return ids
