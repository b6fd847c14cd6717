"""A byte-level BPE tokenizer trained with the `tokenizers` library, saved as a
`PreTrainedTokenizerFast` so that `AutoTokenizer.from_pretrained(folder)` loads it.

Byte-level (GPT-2 style): every byte has a token, so no text is ever unknown. The special tokens serve
all three objectives: `<pad>`, `<s>` (decoder start of the seq2seq), `</s>` (end of document),
`<unk>`, `<mask>` (masked LM) and `<extra_id_0>`... sentinels (T5 span corruption).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .args import TrainArgumentError

SPECIAL = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", mask_token="<mask>")
NUM_SENTINELS = 100


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (special tokens included) on `texts`."""
    sentinels = [sentinel(i) for i in range(NUM_SENTINELS)]
    bpe = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[*SPECIAL.values(), *sentinels],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, additional_special_tokens=sentinels, **SPECIAL)


def load_tokenizer(path: str, arch: str) -> PreTrainedTokenizerFast:
    """A saved tokenizer, checked for the special tokens the objective of `arch` needs."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    needed = {"eos_token": "separates documents"}
    if arch == "encoder":
        needed["mask_token"] = "masked LM replaces tokens with it"
    if arch == "encoder-decoder":
        needed["bos_token"] = "starts the decoder input"
    for name, why in needed.items():
        if getattr(tokenizer, name, None) is None:
            raise TrainArgumentError(f"--tokenizer {path!r} has no {name} ({why} for --arch {arch})")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if arch == "encoder-decoder" and not sentinel_ids(tokenizer):
        raise TrainArgumentError(
            f"--tokenizer {path!r} has no {sentinel(0)} sentinel tokens, which span corruption needs "
            "(--arch encoder-decoder); let swapformer train one (omit --tokenizer)"
        )
    return tokenizer


def sentinel_ids(tokenizer) -> list[int]:
    """Ids of `<extra_id_0>`, `<extra_id_1>`, ... as far as the tokenizer has them."""
    vocab = tokenizer.get_vocab()
    ids = []
    while sentinel(len(ids)) in vocab:
        ids.append(vocab[sentinel(len(ids))])
    return ids


def given_tokenizer(name: str | None, arch: str):
    """The tokenizer --tokenizer names (loaded in every process: cheap, and each raises the same error),
    or None when the run trains its own."""
    if name is None:
        return None
    try:
        return load_tokenizer(name, arch)
    except TrainArgumentError:
        raise
    except (OSError, ValueError) as e:  # what transformers raises for a folder it cannot read
        raise TrainArgumentError(
            f"--tokenizer {name!r} is not a saved tokenizer folder ({e}); give a folder written "
            "by save_pretrained, or omit --tokenizer to train one"
        ) from e
