"""Mutation check of the attention-pattern tests: does each rule have a test that fails without it?

Each mutant removes or alters one rule of the pattern predicate (modeling/attention/masks.py
`AttentionPattern.allowed`; modeling/sparse/bigbird.py the BigBird draw; modeling/attention/lowering.py for flash), of the sparse
backend where it handles a rule itself (sparse_layout.py, sparse_globals.py: the dense pass of global query
rows, the global-key and random-key segments, counting each key once, the band; sparse_native_call.py and
csrc/sparse_native.cpp: the same rules in the native CPU kernels, and rows without keys), or of the pattern's construction (modeling/core/plan.py: global tokens; modeling/caches/cache_layers.py: the caches). For every
mutant the fast tests run in a temporary copy of the repository, so nothing is ever edited in place
(an interrupted run leaves the working tree untouched), and a table says which test caught it.

Usage (from the repository root; ~1-2 min per mutant on one core):

    OMP_NUM_THREADS=1 .venv/bin/python tests/mutation_check.py              # oracle and native-kernel tests
    OMP_NUM_THREADS=1 .venv/bin/python tests/mutation_check.py --tests tests/attention/test_pattern_oracle.py tests/attention/test_patterns.py
    OMP_NUM_THREADS=1 .venv/bin/python tests/mutation_check.py --only "global query"

Exit status 1 when a mutant survives. It lives in tests/ because it measures the tests (it is not a
test itself: pytest collects only test_*.py) and runs them as CI does.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The swapformer package maps these directories as its subpackages (pyproject.toml).
SUBPACKAGES = ("configuration", "conversion", "hub_cards", "modeling", "training")


@dataclass(frozen=True)
class Mutant:
    rule: str
    mutation: str
    path: str
    old: str
    new: str


MUTANTS = [
    # masks.py: the predicate
    Mutant(
        "global query",
        "drop `| global_queries`",
        "modeling/attention/masks.py",
        "            structure = structure | self.global_queries[b, row]\n",
        "            structure = structure\n",
    ),
    Mutant(
        "global key",
        "drop `| global_keys`",
        "modeling/attention/masks.py",
        "            structure = structure | self.global_keys[b, safe]\n",
        "            structure = structure\n",
    ),
    Mutant(
        "window edge (causal)",
        "q - k < w  ->  q - k <= w",
        "modeling/attention/masks.py",
        "return (d < self.window) if self.causal",
        "return (d <= self.window) if self.causal",
    ),
    Mutant(
        "window edge (causal)",
        "q - k < w  ->  q - k < w - 1",
        "modeling/attention/masks.py",
        "return (d < self.window) if self.causal",
        "return (d < self.window - 1) if self.causal",
    ),
    Mutant(
        "window edge (bidirectional)",
        "|q - k| < w  ->  |q - k| <= w",
        "modeling/attention/masks.py",
        "else (d.abs() < self.window)",
        "else (d.abs() <= self.window)",
    ),
    Mutant(
        "window edge (bidirectional)",
        "|q - k| < w  ->  |q - k| < w - 1",
        "modeling/attention/masks.py",
        "else (d.abs() < self.window)",
        "else (d.abs() < self.window - 1)",
    ),
    Mutant(
        "random blocks",
        "drop `| random_blocks`",
        "modeling/attention/masks.py",
        "            structure = structure | self.random_blocks(b, row, q, k)\n",
        "            structure = structure\n",
    ),
    Mutant(
        "random blocks",
        "query block off by one ((q - s) // b -> (q + 1 - s) // b)",
        "modeling/attention/masks.py",
        "qb, kb = (q - start) // self.block_size,",
        "qb, kb = (q + 1 - start) // self.block_size,",
    ),
    Mutant(
        "random blocks",
        "draw seeded without n_key_blocks (bidirectional)",
        "modeling/sparse/bigbird.py",
        "j * 8_191 + (0 if causal else n_key_blocks))",
        "j * 8_191)",
    ),
    Mutant(
        "random blocks",
        "causal draw may pick the next block",
        "modeling/sparse/bigbird.py",
        "choices = range(min(j + 1, n_key_blocks)) if causal",
        "choices = range(min(j + 2, n_key_blocks)) if causal",
    ),
    Mutant(
        "random blocks (start)",
        "counted from index 0, not the sequence's first real token",
        "modeling/attention/masks.py",
        "start, layout = self.random_start[b, row], self.random_index[b, row]",
        "start, layout = 0, self.random_index[b, row]",
    ),
    Mutant(
        "random blocks (causal)",
        "causal draw seeded with the table size (the layout changes as the sequence grows)",
        "modeling/sparse/bigbird.py",
        "j * 8_191 + (0 if causal else n_key_blocks))",
        "j * 8_191 + n_key_blocks)",
    ),
    Mutant(
        "random blocks (layout)",
        "every sequence drawn in the layout of the longest row, not of its own length",
        "modeling/sparse/bigbird.py",
        "blocks = ((lengths + block_size - 1) // block_size).clamp(1, n_blocks)",
        "blocks = lengths * 0 + n_blocks",
    ),
    Mutant(
        "causal",
        "drop `k <= q`",
        "modeling/attention/masks.py",
        "            ok = ok & (k <= q)\n",
        "            ok = ok\n",
    ),
    Mutant(
        "causal",
        "k <= q  ->  k <= q + 1",
        "modeling/attention/masks.py",
        "            ok = ok & (k <= q)\n",
        "            ok = ok & (k <= q + 1)\n",
    ),
    Mutant(
        "padding",
        "drop `key_valid`",
        "modeling/attention/masks.py",
        "            ok = ok & self.key_valid[b, safe]\n",
        "            ok = ok\n",
    ),
    Mutant(
        "packing boundary",
        "drop `same sequence`",
        "modeling/attention/masks.py",
        "            ok = ok & (self.query_packing.ids[b, row] == self.key_packing.ids[b, safe])\n",
        "            ok = ok\n",
    ),
    Mutant(
        "packing boundary",
        "a query also sees the previous sequence",
        "modeling/attention/masks.py",
        "            ok = ok & (self.query_packing.ids[b, row] == self.key_packing.ids[b, safe])\n",
        "            ok = ok & (self.query_packing.ids[b, row] - self.key_packing.ids[b, safe] <= 1)\n",
    ),
    Mutant(
        "padding (flash)",
        "no padding mask for flash_attention_2",
        "modeling/attention/lowering.py",
        "    if pattern.key_valid is None:\n        return None\n    return pattern.key_valid.long()",
        "    return None",
    ),
    Mutant(
        "packing boundary (flash)",
        "no varlen boundaries for flash_attention_2",
        "modeling/attention/lowering.py",
        "        return KernelMask(None, varlen)",
        "        return None",
    ),
    # sparse_layout.py / sparse_globals.py: rules the sparse backend handles itself
    Mutant(
        "global query (sparse)",
        "no dense pass for global query rows",
        "modeling/sparse/sparse_layout.py",
        "if pattern.global_queries is not None and bool(pattern.global_queries.any()):",
        "if False:",
    ),
    Mutant(
        "global query (sparse)",
        "unused write-back slots written too (they land on the last query)",
        "modeling/sparse/sparse_globals.py",
        "batch_idx, slot = (layout.global_rows >= 0).nonzero(as_tuple=True)",
        "batch_idx, slot = (layout.global_rows >= -1).nonzero(as_tuple=True)",
    ),
    Mutant(
        "global query (sparse)",
        "pieces of the global query rows averaged instead of merged by log-sum-exp (no gradients)",
        "modeling/sparse/sparse_globals.py",
        "self.out = self.out.lerp_(out, torch.sigmoid(lse - self.lse)[..., None])",
        "self.out = self.out.lerp_(out, 0.5)",
    ),
    Mutant(
        "global key (sparse)",
        "global-key segment dropped from the merge (no gradients)",
        "modeling/sparse/sparse_globals.py",
        "torch.lerp(o1, o2, share, out=target)",
        "target.copy_(o1)",
    ),
    Mutant(
        "count once (sparse)",
        "the global-key mask skipped in every chunk (a global key inside the band counted twice)",
        "modeling/sparse/sparse.py",
        "glob.masked_blocks = layout.global_key_mask.ne(0).flatten(2).any(-1).any(0).tolist()",
        "glob.masked_blocks = (layout.global_key_mask.ne(0).flatten(2).any(-1).any(0) & False).tolist()",
    ),
    Mutant(
        "global key (sparse)",
        "no global-key segment",
        "modeling/sparse/sparse_layout.py",
        "    if pattern.global_keys is not None:\n        order, present",
        "    if False:\n        order, present",
    ),
    Mutant(
        "random blocks (sparse)",
        "no random-key segment",
        "modeling/sparse/sparse_layout.py",
        "    if pattern.random_table is None:\n        return None, None\n    keys, counted",
        "    if True:\n        return None, None\n    keys, counted",
    ),
    Mutant(
        "random blocks (sparse)",
        "random keys gathered from index 0, not from the row's first real token",
        "modeling/sparse/sparse_layout.py",
        "keys = pick(start)[..., None, None] + chosen",
        "keys = 0 * pick(start)[..., None, None] + chosen",
    ),
    Mutant(
        "count once (sparse)",
        "a global/random key inside the band counted twice",
        "modeling/sparse/sparse_layout.py",
        "    counted = counted & ~in_band[:, :, None, :]\n",
        "",
    ),
    Mutant(
        "count once (sparse)",
        "a random key that is global counted twice",
        "modeling/sparse/sparse_layout.py",
        "        counted = counted & ~is_global[:, :, None, :]\n",
        "",
    ),
    Mutant(
        "window edge (sparse band)",
        "band one key short on the left",
        "modeling/sparse/sparse_layout.py",
        "left, right = pattern.window - 1, (0 if",
        "left, right = pattern.window - 2, (0 if",
    ),
    # cpu/sparse_native_call.py / cpu/csrc/sparse_native.cpp: the native CPU kernels (fp32 inference)
    Mutant(
        "global key (native)",
        "no global keys passed to the kernel",
        "modeling/cpu/sparse_native_call.py",
        "    if layout.global_keys is not None:\n        kg, vg = global_keys_and_values",
        "    if False:\n        kg, vg = global_keys_and_values",
    ),
    Mutant(
        "global query (native)",
        "no pass for the global query rows",
        "modeling/cpu/sparse_native_call.py",
        "    if layout.global_rows is not None:\n        q_rows",
        "    if False:\n        q_rows",
    ),
    Mutant(
        "global query (native)",
        "the global query rows' mask ignored (they see padding keys)",
        "modeling/cpu/csrc/sparse_native.cpp",
        "const float* mrow = masked ? mp",
        "const float* mrow = false ? mp",
    ),
    Mutant(
        "count once (native)",
        "the global-key mask not added (a global key inside the band counted twice)",
        "modeling/cpu/csrc/sparse_native.cpp",
        "              if (grow) row[C + j] += grow[i * gms[3] + j];\n",
        "",
    ),
    Mutant(
        "window edge (native band)",
        "band mask read from its first column where the band was clipped at key 0",
        "modeling/cpu/csrc/sparse_native.cpp",
        "r0 * ms[3] + off;",
        "r0 * ms[3];",
    ),
    Mutant(
        "window edge (native band)",
        "band offset not moved with the keys handed to the kernel (bands past key 0)",
        "modeling/cpu/sparse_native_call.py",
        "layout.band_start - lo, kgt",
        "layout.band_start, kgt",
    ),
    Mutant(
        "padding (native)",
        "a row without any key not zeroed",
        "modeling/cpu/csrc/sparse_native.cpp",
        "if (mx == kNeg) {  // no key for this row",
        "if (false) {  // no key for this row",
    ),
    # plan.py and cache_layers.py: the pattern's construction and the caches
    Mutant(
        "global tokens",
        "position < global_tokens  ->  <=",
        "modeling/core/plan.py",
        "is_global = pos.keys < config.global_tokens",
        "is_global = pos.keys <= config.global_tokens",
    ),
    Mutant(
        "global tokens",
        "ignore global_attention_mask",
        "modeling/core/plan.py",
        "        is_global = is_global | global_mask.bool()\n",
        "        is_global = is_global\n",
    ),
    Mutant(
        "window + global cache",
        "key offset 0 when no global token (the bug fixed with this check)",
        "modeling/caches/cache_layers.py",
        "(self.tail_start if self.tail_start > self.prefix else 0)",
        "(self.tail_start if self.key_prefix else 0)",
    ),
    Mutant(
        "window cache",
        "window of 1 keeps every token (transformers' behaviour, fixed with this check)",
        "modeling/caches/cache_layers.py",
        "        if self.sliding_window == 1 and not self.record_past:",
        "        if False:",
    ),
]


def copy_repo(dest: Path) -> Path:
    """A copy of the repository whose `swapformer` package imports the copy's subpackages: the editable
    install maps `swapformer.modeling` etc. to the original checkout, so the copy's `swapformer/` gets
    links to its own, which Python's path finder (ahead of the editable finder) then resolves."""
    repo = dest / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", "*.egg-info"),
    )
    for name in SUBPACKAGES:
        (repo / "swapformer" / name).symlink_to(repo / name, target_is_directory=True)
    return repo


def apply(repo: Path, mutant: Mutant) -> None:
    path = repo / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(
            f"mutant {mutant.rule!r} / {mutant.mutation!r}: {mutant.old!r} occurs {count} times in {mutant.path}"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(repo: Path, tests: list[str], timeout: int, extensions: Path) -> tuple[bool, str]:
    """(caught, first failing test) for the tests run in the copy; the native kernels are built in
    `extensions` (this run's own directory: a mutant's build never reaches the user's cache)."""
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions))
    check = "import swapformer.modeling.attention.masks as m, sys; print(m.__file__)"
    where = subprocess.run([sys.executable, "-c", check], env=env, cwd=repo, capture_output=True, text=True)
    if not where.stdout.strip().startswith(str(repo)):
        raise SystemExit(
            f"the copy does not import its own code: {where.stdout.strip()} {where.stderr[-500:]}"
        )
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, f"(timeout after {timeout} s)"
    if proc.returncode == 0:
        return False, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    return True, failed[0] if failed else f"(pytest exit {proc.returncode})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tests",
        nargs="+",
        default=["tests/attention/test_pattern_oracle.py", "tests/cpu/test_sparse_native.py"],
    )
    parser.add_argument("--only", help="run the mutants whose rule or mutation contains this text")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or args.only in m.rule or args.only in m.mutation]
    rows = []
    with tempfile.TemporaryDirectory(prefix="swapformer-mutants-") as tmp:
        clean = copy_repo(Path(tmp) / "clean")
        extensions = Path(tmp) / "torch_extensions"
        caught, first = run_tests(clean, args.tests, args.timeout, extensions)
        if caught:
            print(f"the unmutated tests fail ({first}); fix them first", file=sys.stderr)
            return 2
        for mutant in mutants:
            work = Path(tmp) / "mutant"
            shutil.rmtree(work, ignore_errors=True)
            repo = copy_repo(work)
            apply(repo, mutant)
            caught, first = run_tests(repo, args.tests, args.timeout, extensions)
            rows.append((mutant, caught, first))
            print(
                f"{'caught' if caught else 'SURVIVED'}: {mutant.rule} / {mutant.mutation}  {first}",
                flush=True,
            )
    print()
    print("| rule | mutation | file | caught | first failing test |")
    print("|---|---|---|---|---|")
    for mutant, caught, first in rows:
        cells = (mutant.rule, mutant.mutation, mutant.path, "yes" if caught else "**no**", first)
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return 0 if all(caught for _, caught, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
