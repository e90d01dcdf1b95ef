"""Build the demo pairs that ship in the package, offline and deterministically (scripts/build_demo.py).

From the running interpreter's standard-library sources (every `held_out_every`-th file held out):
a byte-level BPE tokenizer (or the attention pair's, reused), a small target trained on next-token prediction
(the recipe's target geometry picks its architecture: a Qwen3 for the attention pair, a Qwen3.5-style Gated
DeltaNet / attention hybrid for the hybrid pair), then a DSpark draft and, for comparison, a DFlash draft
(Markov rank 0, no confidence head) trained in lock-step on the same batches and anchors, and both evaluated
with the real speculative loop on held-out prompts at T = 0 and 1. The target, the DSpark draft and the
tokenizer are written in bf16 with a model card. The target and the drafts are cached in the work folder with
the recipe they were built by (a stage file each), so an interrupted build resumes after its last whole stage.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dspark_cli.runtime.io.outputs import atomic_write_text
from dspark_cli.runtime.train.tiny_target import (HybridGeometry, TargetGeometry, build_tokenizer, evaluate_lm,
                                                  train_causal_lm)
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.trainer import DraftTrainer, save_final, train_lockstep
from dspark_cli.runtime.train.data import (SequenceBank, TokenStream, split_held_out, stdlib_sources,
                                              tokenize_stream)
from dspark_cli.runtime.train.new_draft import DraftShape, new_draft

Log = Callable[[str], None]
STAGE_FILE = "stage.json"
DRAFTS_STAGE_FILE = "drafts_stage.json"  # in the work folder, beside dspark_draft/ and dflash_draft/
GOAL_TAU, GOAL_RATIO = 3.5, 1.15  # the attention pair's acceptance goal at T = 0 (block 7)
HYBRID_GOAL_TAU = 3.0  # the hybrid pair's: enough for speculative decoding to beat plain decoding by 1.5x


@dataclass(frozen=True)
class DemoRecipe:
    vocab_size: int = 1024
    target: TargetGeometry = TargetGeometry(vocab_size=1024, hidden_size=256, intermediate_size=768,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                            head_dim=32)
    target_steps: int = 2500
    target_batch_size: int = 8
    target_seq_len: int = 256
    target_lr: float = 2e-3
    draft: DraftShape = DraftShape(layers=1, block_size=7, target_layers=(1, 3, 6), markov_rank=128)
    draft_options: TrainOptions = TrainOptions(steps=2000, batch_size=8, seq_len=256, anchors=32, lr=2e-3)
    distill_sequences: int = 2048  # drafts train on held-in prompts + the target's own continuations; 0: raw text
    distill_prompt_tokens: int = 32
    held_out_every: int = 25
    eval_prompts: int = 24
    eval_prompt_tokens: int = 48
    eval_new_tokens: int = 128
    seed: int = 0

    @property
    def dflash(self) -> DraftShape:
        return replace(self.draft, markov_rank=0, confidence=False, confidence_with_markov=False)

    @property
    def hybrid(self) -> bool:
        return isinstance(self.target, HybridGeometry)


# The hybrid pair: a Qwen3.5-style target (3 Gated DeltaNet layers to 1 attention layer) half as deep as the
# attention pair's and trained for 300 steps instead of 2500 (transformers' Gated DeltaNet runs its reference
# PyTorch code on CPU, about twice the attention pair's time per step), so that its build fits an hour on two
# shared cores; the attention pair's tokenizer (build_demo's tokenizer_dir); 600 draft steps instead of 2000, on
# half as many self-distilled sequences.
HYBRID_RECIPE = DemoRecipe(
    target=HybridGeometry(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, full_attention_every=4,
                          linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                          linear_value_head_dim=32, linear_conv_kernel_dim=4),
    target_steps=300,
    draft=DraftShape(layers=1, block_size=7, target_layers=(0, 1, 2), markov_rank=128),
    draft_options=TrainOptions(steps=600, batch_size=8, seq_len=256, anchors=32, lr=2e-3),
    distill_sequences=1024)


@dataclass
class DraftResult:
    name: str
    tau: dict[str, float]  # "T=0" / "T=1" -> mean committed tokens per round, pooled over all prompts
    accept_at: dict[str, list[float]]  # per position j: rounds with > j accepted / rounds
    train_tau_estimate: float
    seconds: float


@dataclass
class DemoReport:
    recipe: dict
    corpus: dict
    target_val_loss: float
    seconds: dict[str, float] = field(default_factory=dict)
    drafts: list[DraftResult] = field(default_factory=list)
    sizes_bytes: dict[str, int] = field(default_factory=dict)


def round_to_bf16_(model: torch.nn.Module) -> None:
    """Make fp32 weights exactly what the bf16 files will hold, so training and evaluation see the shipped pair."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def build_demo(out: Path, work: Path, recipe: DemoRecipe = DemoRecipe(), log: Log = print,
               sources: list[Path] | None = None, tokenizer_dir: Path | None = None) -> DemoReport:
    """Build target/ and draft/ into `out`; `work` receives the cached stages and the DFlash draft (evaluated,
    not shipped). `sources`: the corpus files (default: the running interpreter's standard library).
    `tokenizer_dir`: reuse the tokenizer saved there (trained on the same split) instead of training one."""
    out, work = Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 1)
        clock = now
        log(f"{name}: {seconds[name]:.0f} s")

    files = stdlib_sources() if sources is None else sorted(sources)
    train_files, held_files = split_held_out(files, recipe.held_out_every)
    tokenizer = build_tokenizer(train_files, recipe.vocab_size) if tokenizer_dir is None else \
        _saved_tokenizer(tokenizer_dir, recipe.vocab_size)
    train_stream = _stream(train_files, tokenizer)
    held_stream = _stream(held_files, tokenizer)
    corpus = {"python": platform.python_version(), "train_files": len(train_files), "held_out_files": len(held_files),
              "held_out_names": [f.name for f in held_files], "train_tokens": len(train_stream),
              "held_out_tokens": len(held_stream)}
    log(f"corpus: {len(train_files)} training files ({len(train_stream):,} tokens), {len(held_files)} held out")
    lap("tokenizer")

    key = {**_target_key(recipe), "tokenizer_vocab": sorted(tokenizer.get_vocab().items())}
    target, val_loss, target_seconds = _target_stage(work / "target", recipe, key, tokenizer, train_stream,
                                                     held_stream, log)
    target_dir = out / "target"
    _save_target(target, tokenizer, target_dir)
    lap("target")
    if target_seconds is not None:
        seconds["target"] = target_seconds  # the cached stage: report the time it took when it was built

    estimates = _drafts_stage(work, recipe, key, (target, tokenizer, train_stream), seconds, log, lap)
    draft_dir, dflash_dir = out / "draft", work / "dflash_draft"
    draft_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(work / "dspark_draft" / name, draft_dir / name)

    results = []
    for name, folder, estimate in (("DSpark", draft_dir, estimates[0]), ("DFlash", dflash_dir, estimates[1])):
        started = time.perf_counter()
        tau, accept_at = evaluate_pair(target_dir, folder, held_stream, recipe)
        results.append(DraftResult(name, tau, accept_at, round(estimate, 3), round(time.perf_counter() - started, 1)))
        log(f"{name}: τ {tau}")
    lap("evaluation")

    sizes = {name: sum(f.stat().st_size for f in (out / name).rglob("*") if f.is_file())
             for name in ("target", "draft")}
    return DemoReport(recipe=_recipe_dict(recipe), corpus=corpus, target_val_loss=round(val_loss, 4),
                      seconds=seconds, drafts=results, sizes_bytes=sizes)


def _drafts_stage(work: Path, recipe: DemoRecipe, target_key: dict, inputs: tuple, seconds: dict[str, float],
                  log: Log, lap: Callable[[str], None]) -> list[float]:
    """Train the drafts into work/dspark_draft and work/dflash_draft, or reuse them when work/DRAFTS_STAGE_FILE
    says they were built for this target by this same draft recipe. inputs: (target, tokenizer, train_stream).
    -> their training estimates of τ; `seconds` gets the stages' times (the cached build's when reused)."""
    key = json.loads(json.dumps({"target": target_key, **_drafts_key(recipe)}))
    stage_file = work / DRAFTS_STAGE_FILE
    stage = json.loads(stage_file.read_text()) if stage_file.is_file() else {}
    if stage.get("key") == key:
        log(f"reusing the drafts built earlier in {work} (same recipe)")
        seconds.update(stage["seconds"])
        return stage["train_tau_estimates"]
    estimates = _train_drafts(*inputs, recipe, work, log, lap)
    stage = {"key": key, "train_tau_estimates": estimates,
             "seconds": {k: v for k, v in seconds.items() if k in ("self-distillation data", "drafts")}}
    atomic_write_text(stage_file, json.dumps(stage, indent=2) + "\n")  # an interrupt never leaves half a file
    return estimates


def _train_drafts(target, tokenizer, train_stream: TokenStream, recipe: DemoRecipe, folder: Path, log: Log,
                  lap: Callable[[str], None]) -> list[float]:
    """Train the DSpark and the DFlash drafts in lock-step into folder/dspark_draft and folder/dflash_draft.
    -> their training estimates of τ (moving averages)."""
    draft_data = train_stream
    if recipe.distill_sequences:
        draft_data = self_distillation_data(target, train_stream, recipe)
        log(f"self-distillation data: {draft_data.rows.shape[0]} sequences of {draft_data.rows.shape[1]} tokens")
        lap("self-distillation data")

    trainers = []
    for shape in (recipe.draft, recipe.dflash):
        torch.manual_seed(recipe.seed)
        options = replace(recipe.draft_options, seed=recipe.seed)
        draft, _ = new_draft(target, tokenizer, shape, options.anchors_per_sequence(options.seq_len))
        trainers.append(DraftTrainer(target, draft, draft_data, options))
    estimates = [0.0, 0.0]

    def report(step: int, terms) -> None:
        for i, t in enumerate(terms):
            estimates[i] = 0.9 * estimates[i] + 0.1 * t.expected_length if step > 1 else t.expected_length
        if step % 100 == 0:
            log(f"draft step {step}: DSpark loss {terms[0].loss.item():.3f} expected length {estimates[0]:.2f}, "
                f"DFlash loss {terms[1].loss.item():.3f} expected length {estimates[1]:.2f}")

    train_lockstep(trainers, report)
    for trainer, name in ((trainers[0], "dspark_draft"), (trainers[1], "dflash_draft")):
        save_final(trainer.draft, folder / name)
    lap("drafts")
    return estimates


def _drafts_key(recipe: DemoRecipe) -> dict:
    """Everything the drafts' weights depend on besides the target."""
    return {"draft": asdict(recipe.draft), "dflash": asdict(recipe.dflash),
            "draft_options": asdict(recipe.draft_options), "distill_sequences": recipe.distill_sequences,
            "distill_prompt_tokens": recipe.distill_prompt_tokens}


def _saved_tokenizer(folder: Path, vocab_size: int):
    """The tokenizer saved in `folder` (tokenizer.json); ValueError when its vocabulary is not `vocab_size`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {len(tokenizer)} ids, the recipe wants {vocab_size}")
    return tokenizer


def _target_stage(folder: Path, recipe: DemoRecipe, key: dict, tokenizer, train_stream: TokenStream,
                  held_stream: TokenStream, log: Log):
    """Train the target, or reuse `folder` when it holds a target built by this same target recipe (the slowest
    stage; the drafts can then be rebuilt alone). -> (fp32 model with bf16-exact weights, held-out loss,
    seconds of the cached build or None)."""
    from transformers import AutoModelForCausalLM

    stage_file = folder / STAGE_FILE
    stage = json.loads(stage_file.read_text()) if stage_file.is_file() else {}
    if stage.get("key") == json.loads(json.dumps(key)):
        log(f"reusing the target built earlier in {folder} (same recipe)")
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        return model, stage["held_out_loss"], stage["seconds"]
    started = time.perf_counter()
    model = recipe.target.build(tokenizer.eos_token_id, recipe.seed)
    train_causal_lm(model, train_stream, steps=recipe.target_steps, batch_size=recipe.target_batch_size,
                    seq_len=recipe.target_seq_len, lr=recipe.target_lr, seed=recipe.seed,
                    on_step=_every(100, lambda s: log(f"target step {s.step}/{s.steps} loss {s.loss:.3f} "
                                                      f"({s.tokens_per_s:,.0f} tok/s)")))
    round_to_bf16_(model)
    val_loss = evaluate_lm(model, held_stream, recipe.target_seq_len)
    log(f"target held-out loss {val_loss:.3f}")
    _save_target(model, tokenizer, folder)
    stage = {"key": key, "held_out_loss": round(val_loss, 4), "seconds": round(time.perf_counter() - started, 1)}
    atomic_write_text(stage_file, json.dumps(stage, indent=2) + "\n")
    return model, stage["held_out_loss"], None


@torch.no_grad()
def self_distillation_data(target, stream: TokenStream, recipe: DemoRecipe) -> SequenceBank:
    """Random training-text prompts continued by the target itself, alternately greedy and sampled at T = 1, so
    that the drafts learn on the prefixes they will see when drafting for this target. -> [N, seq_len] rows."""
    from transformers import GenerationConfig

    prompt_len, seq_len = recipe.distill_prompt_tokens, recipe.draft_options.seq_len
    generator = torch.Generator().manual_seed(recipe.seed + 1)
    starts = torch.randint(0, len(stream) - prompt_len, (recipe.distill_sequences,), generator=generator)
    prompts = stream.tokens[starts[:, None] + torch.arange(prompt_len)]  # [N, P]
    eos = target.config.eos_token_id
    length = {"max_new_tokens": seq_len - prompt_len, "min_new_tokens": seq_len - prompt_len, "pad_token_id": eos,
              "eos_token_id": eos}
    modes = [GenerationConfig(do_sample=False, **length),
             GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **length)]
    torch.manual_seed(recipe.seed)
    rows = [target.generate(chunk, attention_mask=torch.ones_like(chunk), generation_config=modes[i % 2])
            for i, chunk in enumerate(prompts.split(64))]
    return SequenceBank(torch.cat(rows))


def _target_key(recipe: DemoRecipe) -> dict:
    """Everything the target's weights depend on."""
    return {"vocab_size": recipe.vocab_size, "target": asdict(recipe.target), "steps": recipe.target_steps,
            "batch_size": recipe.target_batch_size, "seq_len": recipe.target_seq_len, "lr": recipe.target_lr,
            "seed": recipe.seed, "held_out_every": recipe.held_out_every, "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def evaluate_pair(target_dir: Path, draft_dir: Path, held_stream: TokenStream, recipe: DemoRecipe):
    """τ (committed tokens per round) of the saved pair with the real speculative loop at T = 0 and T = 1."""
    from dspark_cli.runtime.pair import Pair

    pair = Pair.load(target_dir, draft_dir, device="cpu", dtype="float32")
    prompts = eval_prompts(held_stream, recipe)
    block = pair.block_size
    tau, accept_at = {}, {}
    for temperature in (0.0, 1.0):
        rounds = []
        settings = pair.checked.resolve(temperature=temperature)
        for i, prompt in enumerate(prompts):
            result = pair.generate(prompt, max_new_tokens=recipe.eval_new_tokens, stop_ids=(), settings=settings,
                                   seed=recipe.seed + i)
            rounds.extend(result.stats.rounds)
        key = f"T={temperature:g}"
        tau[key] = round(sum(r.emitted for r in rounds) / len(rounds), 3)
        accept_at[key] = [round(sum(r.accepted > j for r in rounds) / len(rounds), 3) for j in range(block)]
    return tau, accept_at


def eval_prompts(held_stream: TokenStream, recipe: DemoRecipe) -> list[torch.Tensor]:
    """Evenly spaced prompts of eval_prompt_tokens tokens from the held-out stream."""
    n, length = recipe.eval_prompts, recipe.eval_prompt_tokens
    stride = (len(held_stream) - length) // n
    return [held_stream.tokens[i * stride: i * stride + length] for i in range(n)]


def _stream(files: list[Path], tokenizer) -> TokenStream:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return TokenStream(tokenize_stream(texts, tokenizer, tokenizer.eos_token_id))


def _save_target(model, tokenizer, folder: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(folder)
    model.float()
    tokenizer.save_pretrained(folder)


def _every(n: int, callback):
    return lambda step: callback(step) if step.step % n == 0 or step.step == step.steps else None


def _recipe_dict(recipe: DemoRecipe) -> dict:
    doc = asdict(recipe)
    doc["python"] = platform.python_version()
    doc["torch"] = torch.__version__
    doc["threads"] = torch.get_num_threads()
    doc["cpus"] = os.cpu_count()
    return doc


def report_json(report: DemoReport) -> str:
    return json.dumps(asdict(report), indent=2) + "\n"


def report_from_json(text: str, recipe: DemoRecipe) -> DemoReport:
    """The DemoReport a build of `recipe` wrote with report_json; ValueError when it was built by another recipe."""
    doc = json.loads(text)
    build_facts = ("python", "torch", "threads", "cpus")
    built = {k: v for k, v in doc["recipe"].items() if k not in build_facts}
    current = {k: v for k, v in json.loads(json.dumps(_recipe_dict(recipe))).items() if k not in build_facts}
    if built != current:
        raise ValueError("the build report was written by a different recipe; rebuild the pair")
    return DemoReport(**{**doc, "drafts": [DraftResult(**d) for d in doc["drafts"]]})


def model_card(report: DemoReport, recipe: DemoRecipe, build_command: str = "python scripts/build_demo.py",
               speed: str = "") -> str:
    """MODEL_CARD.md for the shipped pair: how it was built (`build_command`) and what it measures; `speed`: the
    Markdown tables of benchmarks/bench_demo_pairs.py, shown in the hybrid pair's card (empty: not measured)."""
    t, d, o = recipe.target, recipe.draft, recipe.draft_options
    dspark, dflash = report.drafts
    corpus = report.corpus
    rows = "\n".join(f"| {r.name} | {r.tau['T=0']:.2f} | {r.tau['T=1']:.2f} | "
                     f"{' '.join(f'{a:.2f}' for a in r.accept_at['T=0'])} |" for r in report.drafts)
    ratio = {k: dspark.tau[k] / dflash.tau[k] for k in dspark.tau}
    minutes = {k: v / 60 for k, v in report.seconds.items()}
    stages = ", ".join(f"{k} {v:.1f}" for k, v in minutes.items())
    if recipe.distill_sequences:
        data = (f"{recipe.distill_sequences} prompts of {recipe.distill_prompt_tokens} tokens drawn from the training "
                f"stream, each continued to {o.seq_len} tokens by the target itself (alternate batches of 64 greedy "
                f"and sampled at T = 1; {minutes['self-distillation data']:.1f} min). Trained on raw text only, the "
                "drafts never learn the target's own habits, such as the repetition loops of its greedy output.")
    else:
        data = "the target's training stream (raw text)."
    mb = {k: v / 1e6 for k, v in report.sizes_bytes.items()}
    words = _card_words(recipe, speed, sum(mb.values()))
    target_row = (f"{words['target']}, {t.num_attention_heads}/"
                  f"{t.num_key_value_heads} heads of {t.head_dim}, MLP {t.intermediate_size}, tied embeddings, vocab "
                  f"{t.vocab_size}; bf16 safetensors + byte-level BPE tokenizer (`<\\|endoftext\\|>` = 0 is eos, "
                  "`<\\|mask\\|>` = 1 is the draft's mask token)")
    draft_row = (f"DSpark draft in DeepSpec format: {d.layers} decoder layer(s), block size {d.block_size}, target "
                 f"layers {list(d.target_layers)}, vanilla Markov head rank {d.markov_rank}, confidence head with "
                 "Markov input; bf16, embed_tokens / lm_head = frozen copies of the target's")
    return f"""# dspark {words['title']}

A tiny {words['family']} target and a DSpark draft for it, trained from scratch on CPU from the Python {corpus['python']}
standard-library sources, so that `dspark generate` works offline out of the box. It writes Python-like
text; it is a demonstration of the speculative-decoding machinery, not a useful language model.{words['intro']}

Rebuild it with `{build_command}` (deterministic for a given interpreter, torch version and thread
count). Minutes per stage with {report.recipe['threads']} torch thread(s) on a {report.recipe['cpus']}-core machine:
{stages}; total {sum(minutes.values()):.0f}.

## Contents

| folder | what | size |
|---|---|---|
| `target/` | {target_row} | {mb['target']:.1f} MB |
| `draft/` | {draft_row} | {mb['draft']:.1f} MB |
{words['wheel']}
## How it was built

- **Corpus**: {corpus['train_files']} standard-library `.py` files (no tests, IDLE or site-packages), sorted by
  path; every {recipe.held_out_every}th file ({corpus['held_out_files']} files, {corpus['held_out_tokens']:,} tokens)
  is held out for evaluation. Training stream: {corpus['train_tokens']:,} tokens.
- **Tokenizer**: {words['tokenizer']}
- **Target**: next-token cross-entropy, AdamW (β 0.9/0.95, weight decay 0.1), peak lr {recipe.target_lr}, warm-up
  then cosine decay, {recipe.target_steps} steps of {recipe.target_batch_size} × {recipe.target_seq_len} tokens
  ({recipe.target_steps * recipe.target_batch_size * recipe.target_seq_len / 1e6:.1f} M tokens). Held-out loss
  {report.target_val_loss:.3f} nats/token. Weights rounded to bf16 before the drafts are trained, so the drafts
  learn the shipped target.
- **Draft training data**: {data}
- **Drafts** (`dspark train`'s objective, docs/train.md): online distillation against the frozen target, {o.anchors}
  random anchors per {o.seq_len}-token window, blocks of {d.block_size} with the non-causal block mask, loss
  {o.ce_alpha}·CE + {o.l1_alpha}·L1(draft, target) + {o.confidence_alpha}·BCE(confidence, 1 − TV), position
  weights exp(−j/{o.decay_gamma:g}), Markov head teacher-forced. {o.steps} steps of {o.batch_size} windows, AdamW
  lr {o.lr}, warm-up {o.warmup_ratio:.0%} then cosine decay. The DFlash draft (Markov rank 0, no confidence head)
  was trained in lock-step with the DSpark draft on exactly the same batches and anchors (same budget); it is not
  shipped.

## Measured acceptance (held-out files)

Real speculative loop (`runtime/decode/speculative.py`), {recipe.eval_prompts} prompts of {recipe.eval_prompt_tokens} tokens
taken evenly from the held-out stream, {recipe.eval_new_tokens} new tokens each, block size {d.block_size}, drafts
sampled at the target's temperature, lossless verification. τ = committed tokens per target forward
(accepted + 1), pooled over all rounds.

| draft | τ at T=0 | τ at T=1 | share of rounds accepting > j drafts at T=0 (j = 0..{d.block_size - 1}) |
|---|---|---|---|
{rows}

DSpark / DFlash: {ratio['T=0']:.2f}× at T=0, {ratio['T=1']:.2f}× at T=1.

{_hybrid_status(dspark.tau['T=0']) if recipe.hybrid else _status(dspark.tau['T=0'], ratio['T=0'])}

A tiny target's greedy output repeats itself a lot (loops over comment lines and identifiers), and a draft that
reads the target's own features learns to follow such loops; that is why τ at T = 0 is this high for a model this
weak. Real targets write less repetitive text, so expect other figures there.
{words['speed']}"""


def _card_words(recipe: DemoRecipe, speed: str, megabytes: float) -> dict[str, str]:
    """What the attention pair's and the hybrid pair's model cards say differently."""
    t = recipe.target
    words = {"title": "demo pair", "family": "Qwen3", "intro": "",
             "target": f"Qwen3ForCausalLM: hidden {t.hidden_size}, {t.num_hidden_layers} layers",
             "tokenizer": f"byte-level BPE, vocabulary {recipe.vocab_size}, trained on the training files only.",
             "speed": "", "wheel": ""}
    if not recipe.hybrid:
        return words
    linear = t.layer_types.count("linear_attention")
    return {**words, "title": "hybrid demo pair", "family": "Qwen3.5-style hybrid",
            "intro": ("\n\nIts target mixes Gated DeltaNet linear-attention layers (a fixed-size recurrent state) with "
                      "full-attention\nlayers, like Qwen3.5: `dspark generate` and `dspark eval` run it by its short "
                      "name, demo-hybrid, to show\nspeculative decoding on a stateful target (docs/stateful.md)."),
             "target": (f"Qwen3_5ForCausalLM: hidden {t.hidden_size}, {t.num_hidden_layers} layers "
                        f"({', '.join(x.replace('_attention', '') for x in t.layer_types)}): {linear} Gated DeltaNet "
                        f"layers of {t.linear_num_key_heads}/{t.linear_num_value_heads} key/value heads of "
                        f"{t.linear_key_head_dim} (conv {t.linear_conv_kernel_dim}), "
                        f"{t.num_hidden_layers - linear} gated attention layer(s)"),
             "wheel": (f"\nThe pair adds {megabytes:.1f} MB (uncompressed) to the package: pyproject.toml's package "
                       "data,\n`runtime/assets/**/*`, ships it beside the attention pair.\n"),
             "tokenizer": ("the attention demo pair's (byte-level BPE, vocabulary "
                           f"{recipe.vocab_size}, trained on the same training files), reused as is."),
             "speed": ("\n## Speed\n\nSpeculative against plain decoding and transformers' prompt lookup decoding on "
                       "held-out prompts, on this pair\nand on the attention pair: `python "
                       "benchmarks/bench_demo_pairs.py` (docs/stateful.md,\nwhich compares several runs: the build "
                       "machine is shared and its figures are noisy). One run:\n" + (f"\n{speed}" if speed else "\nNot measured for this card.\n"))}


def _hybrid_status(tau: float) -> str:
    """The acceptance goal of the hybrid pair (τ >= 3 at T = 0 with block 7)."""
    met = tau >= HYBRID_GOAL_TAU
    return (f"Goal for this pair: τ ≥ {HYBRID_GOAL_TAU} at T = 0; {'met' if met else '**not met**'} (τ {tau:.2f}).")


def _status(tau: float, ratio: float) -> str:
    """The acceptance goal of the demo pair (τ >= 3.5 at T = 0 with block 7, >= 1.15x the DFlash draft)."""
    met = tau >= GOAL_TAU and ratio >= GOAL_RATIO
    return (f"Goal for this pair: τ ≥ {GOAL_TAU} at T = 0 and ≥ {GOAL_RATIO}× the DFlash draft; "
            f"{'met' if met else '**not met**'} (τ {tau:.2f}, {ratio:.2f}×).")
