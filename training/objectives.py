"""Pretraining objectives: token blocks (B, T) in, model inputs with `labels` out.

- decoder: causal LM; labels are the inputs (the model shifts them).
- encoder: masked LM (BERT, https://arxiv.org/abs/1810.04805): 15% of positions are chosen; of those
  80% become `<mask>`, 10% a random token, 10% stay; the loss is taken on the chosen positions.
- encoder-decoder: span corruption (T5, https://arxiv.org/abs/1910.10683, section 3.1.4): noise spans
  covering `noise_density` of the tokens, of mean length `mean_span_length`, are replaced in the input
  by one sentinel each; the target lists each sentinel followed by the tokens it hid. Every block of T
  tokens gives an input and a target of fixed lengths, so batches need no padding.

All randomness comes from the generator passed in, which the loop seeds from (seed, step): a batch is
the same whatever the number of processes and after a resume.
"""

from __future__ import annotations

import torch

from .args import TrainArgs, TrainArgumentError
from .tokenizer import sentinel_ids


class CausalLM:
    shift = True  # the model predicts token t + 1 at position t

    def __init__(self, tokenizer, args: TrainArgs):
        self.seq_len = args.seq_len

    def __call__(self, blocks: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_ids": blocks, "labels": blocks}

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        labels = batch["labels"][:, 1:] if self.shift else batch["labels"]
        return int((labels != -100).sum())


class MaskedLM(CausalLM):
    shift = False

    def __init__(self, tokenizer, args: TrainArgs):
        super().__init__(tokenizer, args)
        self.probability = args.mlm_probability
        self.mask_id = tokenizer.mask_token_id
        special = set(tokenizer.all_special_ids)
        self.ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])

    def __call__(self, blocks, generator):
        chosen = torch.rand(blocks.shape, generator=generator) < self.probability
        action = torch.rand(blocks.shape, generator=generator)
        random_tokens = self.ordinary[torch.randint(len(self.ordinary), blocks.shape, generator=generator)]
        inputs = torch.where(chosen & (action < 0.8), self.mask_id, blocks)
        inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
        return {"input_ids": inputs, "labels": blocks.masked_fill(~chosen, -100)}


class SpanCorruption(CausalLM):
    shift = False

    def __init__(self, tokenizer, args: TrainArgs):
        super().__init__(tokenizer, args)
        n = args.seq_len
        self.num_noise, self.num_spans = self.counts(args)
        self.sentinels = torch.tensor(sentinel_ids(tokenizer))
        if self.num_spans > len(self.sentinels):
            raise TrainArgumentError(
                f"--seq-len {n} with --noise-density {args.noise_density} and --mean-span-length "
                f"{args.mean_span_length} makes {self.num_spans} noise spans, more than the tokenizer's "
                f"{len(self.sentinels)} sentinels; lower --seq-len or raise --mean-span-length"
            )
        self.eos = tokenizer.eos_token_id

    @staticmethod
    def counts(args: TrainArgs) -> tuple[int, int]:
        """(noise tokens, noise spans) of one block of `seq_len` tokens."""
        n = args.seq_len
        num_noise = min(max(1, round(n * args.noise_density)), n - 1)
        return num_noise, max(1, min(round(num_noise / args.mean_span_length), n - num_noise))

    @classmethod
    def lengths_for(cls, args: TrainArgs) -> dict[str, int]:
        """Lengths of the encoder input and the decoder target (each ends with `</s>`)."""
        num_noise, num_spans = cls.counts(args)
        return {
            "encoder input": args.seq_len - num_noise + num_spans + 1,
            "decoder target": num_noise + num_spans + 1,
        }

    def _segments(self, total: int, parts: int, generator) -> torch.Tensor:
        """`total` items cut into `parts` non-empty runs, uniformly at random."""
        cuts = torch.randperm(total - 1, generator=generator)[: parts - 1].sort().values + 1
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])
        return bounds.diff()

    def noise_mask(self, n: int, generator) -> torch.Tensor:
        """(n,) bool: alternating kept and noise runs, starting with a kept one."""
        noise = self._segments(self.num_noise, self.num_spans, generator)
        kept = self._segments(n - self.num_noise, self.num_spans, generator)
        runs = torch.stack([kept, noise], dim=1).flatten()
        return torch.tensor([False, True]).repeat(self.num_spans).repeat_interleave(runs)

    def __call__(self, blocks, generator):
        inputs, targets = [], []
        eos = torch.tensor([self.eos])
        for tokens in blocks:
            noise = self.noise_mask(len(tokens), generator)
            starts = noise & ~torch.cat([torch.tensor([False]), noise[:-1]])
            sentinel = self.sentinels[(starts.cumsum(0) - 1).clamp(min=0)]
            # input: kept tokens, one sentinel in place of each span
            inputs.append(torch.cat([torch.where(starts, sentinel, tokens)[~noise | starts], eos]))
            # target: each span as (sentinel, its tokens)
            pairs = torch.stack([sentinel, tokens], dim=1)[noise].flatten()
            keep = torch.stack([starts, noise], dim=1)[noise].flatten()
            targets.append(torch.cat([pairs[keep], eos]))
        return {"input_ids": torch.stack(inputs), "labels": torch.stack(targets)}


OBJECTIVES = {"decoder": CausalLM, "encoder": MaskedLM, "encoder-decoder": SpanCorruption}


def make_objective(tokenizer, args: TrainArgs):
    return OBJECTIVES[args.arch](tokenizer, args)
