"""A byte-level BPE tokenizer trained locally on the task's corpus, saved in Hugging Face format.

Nothing is downloaded: the tokenizer is trained with `tokenizers` on text the task generates and
wrapped as a `PreTrainedTokenizerFast`, so vLLM and transformers load it from the run folder.
"""

from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]


def train_tokenizer(
    corpus: list[str], vocab_size: int, out_dir: str | Path, *, multiple_of: int = 64
):
    """Train, save to `out_dir` and return the PreTrainedTokenizerFast.

    The vocabulary is padded with unused special tokens to a multiple of `multiple_of`, so the
    embedding splits evenly across tensor-parallel ranks and every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"tokenizer.vocab_size: must be >= {len(alphabet) + len(SPECIAL_TOKENS)} (the byte "
            f"alphabet plus special tokens), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    # Digits are always single tokens (numbers read the same wherever they appear); other
    # merges may cross spaces and punctuation so frequent pieces (". Answer: ") become one token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    padding = -len(fast) % multiple_of
    if padding:
        fast.add_special_tokens(
            {"additional_special_tokens": [f"<|unused_{i}|>" for i in range(padding)]}
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: str | Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))
