"""Byte-level BPE tokenizers trained locally with `tokenizers`, saved in Hugging Face format.

Nothing is downloaded: a tokenizer is trained on text the task generates (or any corpus) and
wrapped as a `PreTrainedTokenizerFast`, so vLLM and transformers load it from a model folder.
`train_tokenizer` is the training run's; `megatron_ba.testing.tiny_hf` builds its test tokenizer
with `train_bpe` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]


def train_bpe(
    corpus: Sequence[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    eos: str = EOS,
    pad: str = EOS,
    split_digits: bool = True,
    use_regex: bool = False,
    multiple_of: int = 1,
    chat_template: str | None = None,
):
    """A byte-level BPE trained on `corpus`, as PreTrainedTokenizerFast.

    split_digits: every digit is its own token (numbers read the same wherever they appear).
    use_regex: GPT-2's word pre-split; without it merges may cross spaces and punctuation, so
    frequent pieces (". Answer: ") become single tokens. The vocabulary is padded with unused
    special tokens to a multiple of `multiple_of`, so an embedding splits evenly across
    tensor-parallel ranks and every id a model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size: must be >= {len(alphabet) + len(special_tokens)} (the byte alphabet "
            f"plus special tokens), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)
    padding = -len(fast) % multiple_of
    if padding:
        fast.add_special_tokens(
            {"additional_special_tokens": [f"<|unused_{i}|>" for i in range(padding)]}
        )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def train_tokenizer(
    corpus: Sequence[str], vocab_size: int, out_dir: str | Path, *, multiple_of: int = 64
):
    """The training run's tokenizer: digits split, vocabulary padded to `multiple_of`; saved."""
    try:
        fast = train_bpe(corpus, vocab_size, multiple_of=multiple_of)
    except ValueError as e:
        raise ValueError(f"tokenizer.{e}") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: str | Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def load_hf_tokenizer(path: str | Path):
    """A model's own tokenizer (`tokenizer.kind: hf`): its folder, with its chat template.

    Needs a pad token for right-padded training batches: a tokenizer without one pads with EOS
    (the padding is masked everywhere; nothing attends to or is scored on it).
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer.path: {str(path)!r} is not a folder")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer.path: no tokenizer could be loaded from {path}: {e}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer.path: the tokenizer in {path} has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
