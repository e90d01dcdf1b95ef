"""Mutation audit: apply each hand-made bug to a copy of the source, run the tests that should catch it, restore.

    python scripts/mutation_audit.py [ID ...]     # all mutations, or the named ones

Works on a temporary copy of src/, tests/ and scripts/ (the checkout is never edited). Prints one line per
mutation, CAUGHT (with the first failing test) or MISSED, and ends with "N/N caught". The list is the audit of issue 22 (sampling,
drafting, training, metrics, validate), plus the per-context acceptance mutations and those of eval at
scale, calibration, the verify budget and run-file saving (E1-E12), and bench markov's gated / RNN
heads (B1-B3), the bugs a later audit found the suite let pass (H1-H13), and the engines', the training feature
contract's, regen's and bench serve's (N1-N9), the Gated DeltaNet score pass's and the stateful rollback's
position count (G1-G5), the demo-large pair's inert weights (L1-L4) and whether speculation pays: the engine cost
model and plan's verdict (P1-P4), DFlash2 drafts handed to the engines (Y1-), DFlash2's convolution, selector, walk and training (F1-F8), quantized GGUFs with the acceptance guard (Q1-), and validate on
GGUF files, the silent-degradation rules and the probe (R1-R7).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
R = "src/dspark_cli/runtime/"


@dataclass(frozen=True)
class Mutation:
    id: str
    what: str
    file: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


def m(id, what, file, edits, *tests):
    return Mutation(id, what, R + file, tuple(edits), tuple(test_path(t) for t in tests))


def test_path(name: str) -> str:
    """tests/<folder>/<name>, or tests/<name> (tests/ mirrors the source folders); a node id keeps its ::part."""
    file, _, node = name.partition("::")
    found = next(ROOT.joinpath("tests").rglob(file))
    return str(found.relative_to(ROOT)) + (f"::{node}" if node else "")


KNOWN = "test_known_values.py"
ROUND = "test_round_acceptance.py"
SWEEP = "test_trust_sweep.py"
CALIBRATION = "test_calibration.py"
MUTATIONS = [
    m("S1", "q over the target vocabulary without the request's top-k/top-p", "decode/speculative.py",
      [("probs = sampling.target_probs(logits, drafter.params)",
        "probs = sampling.target_probs(logits, SamplingParams(temperature=drafter.params.temperature))")], ROUND),
    m("S2", "temperature applied after top-k/top-p", "decode/sampling.py",
      [("    scaled = scaled / params.temperature\n", ""),
       ("        scaled = scaled.masked_fill(drop, float(\"-inf\"))\n    return scaled",
        "        scaled = scaled.masked_fill(drop, float(\"-inf\"))\n    return scaled / params.temperature")],
      KNOWN),
    m("S3", "top-p cut keeps one token too many (mass exactly p)", "decode/sampling.py",
      [("mass_before >= params.top_p", "mass_before > params.top_p")], KNOWN),
    m("S4a", "near-one-hot rows sampled as greedy (sample)", "decode/sampling.py",
      [("one_hot = probs.amax(-1) == 1.0", "one_hot = probs.amax(-1) > 0.99")], KNOWN),
    m("S4b", "near-one-hot target rows verified as greedy (accept_batch)", "decode/sampling.py",
      [("if bool((target_probs.amax(-1) == 1.0).all()):", "if bool((target_probs.amax(-1) > 0.99).all()):")],
      KNOWN),
    m("D1", "DFlash layout takes hidden rows from the start of the block", "decode/speculative.py",
      [("[0, n_queries - n_draft :]", "[0, :n_draft]")], KNOWN),
    m("D2", "RMSNorm eps added after the rsqrt", "model/layers.py",
      [("xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)",
        "xf * (torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) + self.eps)")], KNOWN),
    m("D3", "dspark_bonus_anchor true resolves to the N-query layout", "checkpoint/config.py",
      [("    if raw.get(\"dspark_bonus_anchor\"):\n        return False",
        "    if raw.get(\"dspark_bonus_anchor\"):\n        return True")], KNOWN),
    m("T1", "TV/L1 weight 0.9 -> 0.09", "train/options.py", [("l1_alpha: float = 0.9", "l1_alpha: float = 0.09")],
      KNOWN),
    m("T2", "position weights reversed", "train/loss.py", [("torch.exp(-j / gamma)", "torch.exp(-j.flip(0) / gamma)")],
      KNOWN),
    m("T3a", "confidence target 1 - L1 instead of 1 - TV", "train/loss.py",
      [("accept = (1.0 - 0.5 * l1_per_slot)", "accept = (1.0 - l1_per_slot)")], KNOWN),
    m("T3b", "confidence target 1 - accept", "train/loss.py",
      [("binary_cross_entropy_with_logits(confidence_logits.float(), accept,",
        "binary_cross_entropy_with_logits(confidence_logits.float(), 1.0 - accept,")], KNOWN),
    m("T4", "cosine floor 10% -> 0%", "train/tiny_target.py", [("peak * (0.1 + 0.9 *", "peak * (0.0 + 1.0 *")], KNOWN),
    m("T5", "training windows never start at the last offset", "train/data.py",
      [("len(self) - seq_len + 1, (batch_size,)", "len(self) - seq_len, (batch_size,)")], KNOWN),
    m("M1a", "eval: tau's bootstrap resamples rounds", "measure/evaluation.py",
      [("    tau = bootstrap_ratio(emitted, rounds)",
        "    tau = bootstrap_ratio([float(r['emitted']) for p in results for r in p.rounds],\n"
        "                          [1.0 for p in results for r in p.rounds])")], KNOWN),
    m("M1b", "generate --json: tau's bootstrap resamples rounds", "measure/evaluation.py",
      [("    return bootstrap_ratio(emitted, [float(len(s.rounds)) for s in stats])",
        "    return bootstrap_ratio([float(r.emitted) for s in stats for r in s.rounds],\n"
        "                           [1.0 for s in stats for r in s.rounds])")], KNOWN),
    m("M2", "ECE bins by round() instead of floor", "measure/metrics.py",
      [("b = min(int(p * bins), bins - 1)", "b = min(round(p * bins), bins - 1)")], KNOWN),
    m("V1", "a d2t of the wrong length reported as a warning", "checkpoint/rules/tensors.py",
      [('out.add("DSP202", f"{spec.name} has shape', 'out.add("DSP204" if spec.name == "d2t" else "DSP202", '
                                                     'f"{spec.name} has shape')], "test_validate_rules.py"),
    m("V2", "a safetensors entry spanning more bytes than its shape needs is accepted", "checkpoint/read.py",
      [("if info.nbytes != info.numel * DTYPE_BYTES[dtype]:", "if info.nbytes < info.numel * DTYPE_BYTES[dtype]:")],
      "test_validate_rules.py"),
    m("A1", "q computed at temperature 1 whatever the draft sampled with", "decode/speculative.py",
      [("probs = sampling.target_probs(logits, drafter.params)",
        "probs = sampling.target_probs(logits, SamplingParams(1.0, drafter.params.top_p, drafter.params.top_k))")],
      ROUND),
    m("A2", "residual distribution is p instead of max(p - q, 0)", "decode/sampling.py",
      [("residual = (p_next - q_next).clamp_min(0.0)", "residual = p_next")], ROUND),
    # the audit of the code this issue added (the sweep and the validate cases must see each)
    m("O1", "--log-jsonl not checked against the inputs", "train/output.py",
      [('    check_output_file(log, inputs, "the log-jsonl option file")\n', "")], SWEEP),
    m("O12", "the bounded reader reads a file over its size cap", "io/reading.py",
      [("    elif limit is not None and info.st_size > limit:", "    elif False:")], "test_reading.py",
      "test_checkpoint.py"),
    m("O2", "serve lets -sc through", "engines/vllm.py", [('    if flag.startswith("-sc"):\n        return True\n', "")],
      SWEEP),
    m("O3", "--threads not bounded by the cores", "threads.py",
      [("if not 1 <= requested <= cores:", "if not 1 <= requested:")], "test_threads.py", SWEEP),
    m("O4", "validate accepts any hidden_act", "checkpoint/families/qwen3.py",
      [('view["hidden_act"] != "silu"', 'view["hidden_act"] not in ("silu", "bogus")')], SWEEP,
      "test_validate_rules.py"),
    m("O5", "errors do not name what was already written", "../cli/render.py",
      [("    written = files.written_outputs()\n    if not written:", "    written = []\n    if not written:")],
      SWEEP),
    m("O6", "the target's config is not built before loading", "checkpoint/target_files.py",
      [("        return None\n    from transformers import AutoConfig",
        "        return None\n    return None\n    from transformers import AutoConfig")], SWEEP),
    m("O7", "a full disk inside an atomic folder is not worded", "io/outputs.py",
      [("        if is_disk_error(error):\n            state =", "        if False:\n            state =")], SWEEP),
    m("O8", "eval's SIGTERM does not name the run file", "../cli/eval.py",
      [("            stop.kept = (f\"the {len(run.results)} finished", "            _ = (f\"the {len(run.results)} finished")],
      SWEEP),
    m("O9", "an unstartable vllm is a traceback", "engines/vllm.py",
      [("        os.execvp(argv[0], argv)\n    except OSError as error:",
        "        os.execvp(argv[0], argv)\n    except ZeroDivisionError as error:")], SWEEP),
    m("O10", "a weight stored in another shape than the config implies is loaded", "model/target.py",
      [("    if mismatched:\n", "    if False:\n")], SWEEP),
    m("O11", "atomic files claim the old file was kept when it was not", "io/outputs.py",
      [('state = "keeps its earlier content" if existed else "was not created"',
        'state = "keeps its earlier content"')], SWEEP),
    # eval at scale, calibration and the verify budget
    m("E1", "eval shards prompts with overlap", "measure/evaluation.py",
      [("    return items[rank::world_size]", "    return items[rank:rank + len(items) // world_size + 1]")],
      "test_eval_dist.py"),
    m("E2", "STS fitted on the per-slot confidence instead of the survival", "measure/calibration.py",
      [("_ece(survival[rows] * torch.sigmoid(", "_ece(torch.sigmoid(")], CALIBRATION),
    m("E3", "replay counts a token past the verify length", "measure/replay.py",
      [("    accepted = min(r.accepted, n)\n", "    accepted = min(r.accepted, n + 1)\n")], "test_replay.py"),
    m("E4", "the held-out split ignores the prompt sets", "measure/calibration.py",
      [("    for name in sorted({key[0] for key in ordered}):\n"
        "        members = [key for key in ordered if key[0] == name]",
        "    for name in [None]:\n        members = list(ordered)")], CALIBRATION),
    m("E5", "the ECE floor averages signed gaps", "measure/calibration.py",
      [("return float((gaps.abs().sum(dim=1)", "return float((gaps.sum(dim=1).abs()")], CALIBRATION),
    m("E6", "the STS file records the default split, not the one used", "measure/calibration.py",
      [('"fraction": self.fraction, "seed": self.seed', '"fraction": HOLDOUT_FRACTION, "seed": SPLIT_SEED')],
      CALIBRATION),
    m("E7", "the NVFP4 gather kernel drops the odd elements (gated / RNN latents)", "../kernels/markov.py",
      [("dots = tl.sum(w_even * e_even[None, :] + w_odd * e_odd[None, :], axis=1)  # [BLOCK_T]",
        "dots = tl.sum(w_even * e_even[None, :], axis=1)  # [BLOCK_T]")], "test_families.py"),
    m("E8", "a replayed k competes with the measured run of block size k", "measure/replay.py",
      [(" and not (row.rule.kind == \"fixed\" and row.rule.value in measured)]", "]")], "test_replay.py"),
    m("E9", "measured runs of other prompts are accepted", "measure/replay.py",
      [("    if keys != base_keys:\n", "    if False:\n")], "test_replay.py"),
    m("E10", "a saved line is reused for a replaced result", "measure/evaluation.py",
      [("and cache[same][0] is self.results[same]:", ":")], "test_eval.py"),
    m("E11", "the run file is rewritten after every prompt whatever a save costs", "measure/evaluation.py",
      [("        if time.perf_counter() - self.last_end >= SAVE_SPACING * self.last_cost:\n", "        if True:\n")],
      "test_eval.py"),
    m("E12", "an interrupted eval does not write what is unsaved", "../cli/eval.py",
      [("        save.flush()  # what finished is kept whatever stopped the run\n", "")], "test_eval.py"),
    # bench markov with gated / RNN heads
    m("B1", "the bench's token check scores a gated / RNN walk with W1[prev] instead of the head's latents",
      "bench/walks.py", [("    if w.head is None:\n        return embeds\n", "    return embeds\n")], "test_bench.py"),
    m("B2", "the bench's reference walk drops the head", "bench/walks.py",
      [("    if w.head is not None:\n        strategy", "    if False:\n        strategy")], "test_bench.py"),
    m("B3", "a gated / RNN head's projections are not counted in the weight bytes", "bench/report.py",
      [("block * batch * r * head.weights.w1.element_size() + block * _projection_bytes(head)",
        "block * batch * r * head.weights.w1.element_size()")], "test_bench.py"),
    # tests that could not fail (H1-H13)
    m("H1", "the first token after the prompt sampled without top-k/top-p", "decode/speculative.py",
      [("first = int(sampling.sample(sampling.target_probs(logits[None], params), generator)[0])",
        "first = int(sampling.sample(sampling.target_probs(logits[None], "
        "SamplingParams(temperature=params.temperature)), generator)[0])")],
      ROUND + "::test_the_first_token_after_the_prompt_is_drawn_within_top_k_and_top_p"),
    m("H2", "eval --compare flags a significant rise but not a significant drop", "measure/evaluation.py",
      [("significant = difference.low > 0 or difference.high < 0", "significant = difference.low > 0")],
      "test_eval.py::test_compare_pairs_by_prompt_and_judges_significance"),
    m("H3", "resume matches finished prompts by set and index, not by the prompt's text", "measure/evaluation.py",
      [("        return set_name, index, prompt\n", "        return set_name, index, \"\"\n")],
      "test_eval.py::test_a_finished_prompt_counts_only_for_the_same_prompt_text"),
    m("H4", "calibration's held-out split keyed per run: one prompt lands on both sides", "measure/calibration.py",
      [("by_prompt.setdefault((r.set_name, r.index, r.prompt), [])",
        "by_prompt.setdefault((r.set_name, r.index, r.prompt, name), [])")],
      CALIBRATION + "::test_a_prompt_in_two_runs_stays_on_one_side_of_the_split"),
    m("H5", "ece_before scored on the fitting prompts instead of the held-out ones", "measure/calibration.py",
      [("    before = survival_calibration(held, [1.0] * block, block)",
        "    before = survival_calibration(fitting, [1.0] * block, block)")],
      CALIBRATION + "::test_ece_before_and_after_score_the_same_held_out_pairs"),
    m("H6", "calibrate counts drafted positions as verified (cut and stop-token rounds add false rejections)",
      "measure/calibration.py", [('data.verified.append(r["proposed"])', 'data.verified.append(r["drafted"])')],
      CALIBRATION + "::test_positions_drafted_but_not_verified_have_no_outcome"),
    m("H7", "plan recommends an STS-calibrated row, which vLLM cannot deploy", "measure/replay.py",
      [("\n              and not row.rule.calibrated and not (", "\n              and not (")],
      "test_replay.py::test_the_recommendation_is_a_row_vllm_can_deploy"),
    m("H8a", "a Gemma-4 draft without the full-attention RoPE entry rotates every frequency",
      "checkpoint/families/gemma4.py", [('"partial_rotary_factor": 0.25,', '"partial_rotary_factor": 1.0,')],
      "test_checkpoint.py::test_gemma4_drafts_default_their_rope_and_activation_like_transformers"),
    m("H8b", "a Gemma-4 draft's activation read from hidden_act instead of hidden_activation",
      "checkpoint/families/gemma4.py", [('view.get("hidden_activation", "gelu_pytorch_tanh")',
                                         'view.get("hidden_act", "gelu_pytorch_tanh")')],
      "test_checkpoint.py::test_gemma4_drafts_default_their_rope_and_activation_like_transformers"),
    m("H9", "a draft loaded from NVFP4 and saved keeps the input's quantization_config", "model/draft_io.py",
      [('    config.pop("quantization_config", None)\n', "")],
      "test_draft.py::test_a_draft_loaded_from_nvfp4_is_saved_dense_without_its_quantization_config"),
    m("H10", "the target check accepts layer_types longer than the target's depth", "checkpoint/target_files.py",
      [("(count(layers) and len(types) != layers)", "(count(layers) and len(types) < layers)")],
      "test_target_files.py"),
    m("H11", "training compares each block slot with the target's distribution one position late", "train/loss.py",
      [("target_index=positions.clamp(max=T - 1),", "target_index=(positions + 1).clamp(max=T - 1),")],
      "test_train.py::test_each_block_slot_is_compared_with_the_targets_distribution_at_its_own_position"),
    m("H12", "train's target layers accept the target's last layer (post-norm)", "train/new_draft.py",
      [("layers[-1] > num_layers - 2:", "layers[-1] > num_layers - 1:")],
      "test_train.py::test_target_layers_stop_before_the_targets_last_layer"),
    m("H13", "validate does not report repeated target layer ids (DSP018)", "checkpoint/rules/config_rules.py",
      [("if any(b <= a for a, b in zip(values, values[1:])):", "if any(b < a for a, b in zip(values, values[1:])):")],
      "test_validate_rules.py::test_rule_triggers"),
    # the engines, the training feature contract, regen and bench serve (N1-N10)
    m("N1", "vLLM's verdict on a Gemma-4 draft drops its notes (the confidence head counted as served)",
      "engines/vllm.py", [("plan=plan_serve, rules=rules,", "plan=plan_serve,")],
      "test_engines.py::test_each_engine_verdict"),
    m("N2", "train copies a Gemma-4 target's attention_k_eq_v false (vLLM refuses the draft, DSP041)",
      "checkpoint/families/gemma4.py", [("        attention_k_eq_v=True,\n", "")], "test_train_families.py"),
    m("N3", "serve --engine trtllm writes an STS path alone into the YAML", "engines/trtllm.py",
      [("    if request.calibration is not None:\n        raise DsparkError(\"TensorRT-LLM",
        "    if False:\n        raise DsparkError(\"TensorRT-LLM")],
      "test_engines.py::test_trtllm_takes_no_sts_file_from_dspark"),
    m("N4", "features captured from hidden_states[id] (the layer before) instead of [id + 1]", "train/features.py",
      [("decoder.get_input_embeddings() if k == -1 else layers[k] for k",
        "decoder.get_input_embeddings() if k <= 0 else layers[k - 1] for k")], "test_features.py"),
    m("N5", "the target's distribution computed at every block slot, not only the valid ones", "train/features.py",
      [("logits = self(rows.view(B, A, K, -1)[valid])  # [n_valid, V]\n        out = logits.new_zeros(B, A, K, "
        "logits.shape[-1])\n        out[valid] = logits\n        return out",
        "return self(rows.view(B, A, K, -1)) * valid[..., None]")],
      "test_features.py::test_the_lm_head_sees_only_the_valid_anchor_block_slots"),
    m("N6", "train's τ counts every matching slot, not the chained prefix", "train/tau.py",
      [("return matches.long().cumprod(-1).sum(-1)", "return matches.long().sum(-1)")], "test_tau.py"),
    m("N7", "speculators files read without the target's final norm", "train/speculators.py",
      [("last = norm(hidden[:, -1].to(device=weight.device, dtype=weight.dtype))",
        "last = hidden[:, -1].to(device=weight.device, dtype=weight.dtype)")],
      "test_features_cache.py::test_speculators_files_read_as_the_contract"),
    m("N8", "regen stores the llama.cpp reply's ids re-tokenized from its text", "regen/client.py",
      [("token_ids=_ids(_field(done, \"tokens\", list, \"/completion\"), \"/completion\"),",
        "token_ids=_ids(_field(server.post(\"/tokenize\", {\"content\": done[\"content\"]}), \"tokens\", list, "
        "\"/tokenize\"), \"/tokenize\"),")], "test_regen.py"),
    m("N9", "bench serve ignores llama.cpp's draft_n_accepted", "bench/engine_metrics.py",
      [("timings.get(\"draft_n_accepted\", 0)", "0")], "test_engine_metrics.py"),
    # the Gated DeltaNet score pass (G1-G3)
    m("G1", "the score pass keeps the state after the last scored position, not the accepted one",
      "model/gdn_scoring.py", [("        if kept != self.scored:\n            for layer in layers:",
                                 "        if False:\n            for layer in layers:")], "test_gdn_scoring.py"),
    m("G2", "the conv state kept one position late", "model/gdn_scoring.py",
      [("self.conv_window[..., kept : kept + width]", "self.conv_window[..., kept + 1 : kept + 1 + width]")],
      "test_gdn_scoring.py"),
    m("G3", "the kept recurrent state without the start state's decay", "model/gdn_scoring.py",
      [("return (self.log_decay[:, kept - 1].exp()[:, None, None] * self.start",
        "return (self.start")], "test_gdn_scoring.py"),
    m("G4", "the score pass leaves transformers 5.25's position count where it was", "model/gdn_scoring.py",
      [("    if count is not None:  # as transformers' update_conv_state counts a multi-token forward\n        count.add_(length)",
        "    if False:\n        count.add_(length)")], "test_gdn_scoring.py"),
    m("G5", "the snapshot of a stateful target leaves out transformers 5.25's position count", "model/target_state.py",
      [("        if token_count(layer) is not None:", "        if False:")], "test_stateful_targets.py"),
    # the demo-large pair's inert layers (L1-L3)
    m("L1", "an inert layer's mlp.down_proj random, not zero", "train/demo_large.py",
      [('ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")', 'ZEROED = ("self_attn.o_proj.weight",)')],
      "test_demo_large.py::test_the_grown_target_has_the_demo_targets_logits_and_greedy_tokens"),
    m("L2", "the inert layers inserted before the trained ones (the draft's layer ids read other states)",
      "train/demo_large.py",
      [("    tensors = load_file(str(source / WEIGHTS))  # name -> tensor in the source's dtype\n",
        "    tensors = {__import__('re').sub(r'layers\\.(\\d+)\\.', lambda m: f'layers.{int(m[1]) + extra_layers}.', "
        "n): t for n, t in load_file(str(source / WEIGHTS)).items()}\n"),
       ('if name.startswith(f"{LAYER_PREFIX}0.")}', 'if name.startswith(f"{LAYER_PREFIX}{extra_layers}.")}'),
       ("for layer in range(depth, depth + extra_layers):", "for layer in range(extra_layers):"),
       ('removeprefix(f"{LAYER_PREFIX}0.")', 'removeprefix(f"{LAYER_PREFIX}{extra_layers}.")')],
      "test_demo_large.py::test_speculation_accepts_on_the_grown_target_as_on_the_demo_target"),
    m("L3", "the grown config keeps the source's num_hidden_layers", "train/demo_large.py",
      [('"num_hidden_layers": depth + extra_layers,', '"num_hidden_layers": depth,')],
      "test_demo_large.py::test_the_gguf_holds_every_layer"),
    m("L4", "a widened MLP unit's down_proj column random, not zero", "train/demo_large.py",
      [("torch.zeros(tensor.shape[0], units, dtype=tensor.dtype)",
        "torch.randn(tensor.shape[0], units, dtype=tensor.dtype)")],
      "test_demo_large.py::test_inert_mlp_units_write_zero_and_read_real_weights"),
    # does speculation pay (P1-P4): the engine profile's cost model and plan's verdict
    m("P1", "the draft charged once per step: every concurrency priced with the R = 1 speculative step",
      "measure/engine_profile.py",
      [("measured = {m: self.spec[m, requests, context][repeat] - self.verify_ms(requests, m + 1, context)",
        "measured = {m: self.spec[m, 1, context][repeat] - self.verify_ms(1, m + 1, context)")],
      "test_verdict.py::test_the_draft_is_paid_per_sequence_so_its_share_grows_with_concurrency"),
    m("P2", "dspark's own draft time (the runs' draft + Markov + bookkeeping seconds) added to the engine's step",
      "measure/verdict.py",
      [("    steps = profile.step_ms(requests, context, candidate.n, verified)\n",
        "    steps = [s + 1000.0 * OVERHEAD_S[0] for s in profile.step_ms(requests, context, candidate.n, verified)]\n"),
       ("        outcomes = [replay_round(r, candidate.verify_length(r)) for r in rounds]\n",
        "        outcomes = [replay_round(r, candidate.verify_length(r)) for r in rounds]\n"
        "        OVERHEAD_S[0] = sum(r.overhead_s for r in rounds) / len(rounds)\n"),
       ("MIN_ROUNDS = 20\n", "MIN_ROUNDS = 20\nOVERHEAD_S = [0.0]\n")],
      "test_verdict.py::test_the_runs_own_draft_times_change_no_prediction"),
    m("P3", "acceptance read from every round, not the context's bucket", "measure/verdict.py",
      [("if bucket[0] <= position < bucket[1]]", "if True]")],
      "test_verdict.py::test_each_context_is_judged_on_its_own_rounds"),
    m("P4", "the draft length chosen by acceptance (τ), not by tokens/s", "measure/verdict.py",
      [("best = max(predictions, key=lambda p: p.tokens_per_s)", "best = max(predictions, key=lambda p: p.tau)")],
      "test_verdict.py::test_the_draft_length_is_chosen_by_tokens_per_second"),
    # issue 37 (trust, round 5), classes 1, 2 and 6 (W1-W11): the one output check, side files and true messages
    # about what was written; network faults that lose no work; SIGTERM, ragged run files, eval --resume's words
    m("W1", "serve's engine config file written without the output check", "../cli/serve.py",
      [("    if writes_files:\n        written =", "    if False:\n        written =")],
      *(f"{SWEEP}::test_sweep[writes:trtllm-yaml-{case}]" for case in ("is-the-from-plan-file", "is-the-json-file"))),
    m("W2", "the output check ignores force: an existing file refused only when published", "io/outputs.py",
      [("        if force is False and os.path.lexists(", "        if False and os.path.lexists(")],
      "test_serve_client.py::test_cli_json_plot_exclusive_and_failures"),
    m("W3", "messages name outputs that are no longer there (a renamed temporary file)", "io/outputs.py",
      [("    return [path for path in _written if os.path.lexists(path)]", "    return list(_written)")],
      "test_serve_client.py::test_a_request_that_produced_no_tokens_failed_and_the_run_says_why"),
    m("W4", "bench serve: a request that produced no tokens recorded as a success", "bench/serve.py",
      [("            if result.ok and result.tokens == 0:", "            if False:")],
      "test_serve_client.py::test_a_request_that_produced_no_tokens_failed_and_the_run_says_why"),
    m("W5", "bench serve's SIGTERM mapped to 130", "../cli/bench.py",
      [("        raise report.stop  #", "        raise KeyboardInterrupt  #")],
      "test_serve_client.py::test_an_interrupt_prints_what_was_measured"),
    m("W6", "regen: a reply cut mid-body or not HTTP escapes (the run aborts)", "regen/client.py",
      [("        except http.client.HTTPException as error:", "        except ZeroDivisionError as error:")],
      "test_regen.py::test_any_failure_of_one_request_is_its_error_record_and_the_rest_are_kept"),
    m("W7", "regen: an unexpected exception of one request aborts the run", "regen/run.py",
      [("        except Exception as error:  # whatever else", "        except ZeroDivisionError as error:  # whatever else")],
      "test_regen.py::test_any_failure_of_one_request_is_its_error_record_and_the_rest_are_kept"),
    m("W8", "bench engine: an answer without timings is a KeyError in a request thread", "bench/engine.py",
      [("        if missing:\n            raise DsparkError(f\"the server at {self.url} answered POST /completion without",
        "        if False:\n            raise DsparkError(f\"the server at {self.url} answered POST /completion without")],
      "test_bench_engine.py::test_an_answer_without_timings_is_one_sentence"),
    m("W9", "SIGTERM while the options are parsed: a traceback, exit 1", "../cli/__init__.py",
      [("    except Terminated as stop:  #", "    except ZeroDivisionError as stop:  #")],
      f"{SWEEP}::test_sigterm_before_a_command_starts_exits_143"),
    m("W10", "a ragged round passes the run-file check (a tensor-shape message later)", "measure/run_file.py",
      [("    if r[\"drafted\"] != block:", "    if False:")],
      "test_run_file.py::test_a_ragged_round_is_one_sentence_naming_the_file_and_the_round"),
    m("W11", "eval --resume refuses the value the run resolved to", "../cli/eval.py",
      [(" or _same_request(key, given[key], resolved):", ":")],
      "test_eval.py::test_resume_accepts_the_command_line_that_made_the_run"),
    m("W12", "convert's --json not checked against --target (it could replace the target's config.json)",
      "../cli/convert.py", [(' + local_inputs("target", [target])', "")],
      f"{SWEEP}::test_sweep[writes:convert-json-is-the-target-config]"),
    # DFlash2 drafts for the engines (Y1-): the GGUF llama.cpp loads
    m("Y1", "the GGUF writer transposes the selector's tensors (codebooks and hidden projection)", "convert/gguf.py",
      [("    data = _array(ckpt, info)\n    if len(info.shape) == 1 or dflash2_gguf.kept_f32(name):",
        "    data = _array(ckpt, info)\n    data = np.ascontiguousarray(data.T) if name.startswith('selector_') else data\n"
        "    if len(info.shape) == 1 or dflash2_gguf.kept_f32(name):")],
      "test_convert_dflash2_gguf.py::test_selector_and_conv_tensors_are_the_checkpoints_untransposed"),
    m("Y2", "the GGUF writer writes the group size as dflash.conv_kernel_size and the kernel as the group",
      "convert/dflash2_gguf.py",
      [('uints = {f"{ARCH}.{key}": getattr(keys, key) for key in SELECTOR_KEYS}',
        'uints = {f"{ARCH}.{key}": getattr(keys, {"conv_group_size": "conv_kernel_size", "conv_kernel_size": '
        '"conv_group_size"}.get(key, key)) for key in SELECTOR_KEYS}')],
      "test_convert_dflash2_gguf.py::test_selector_keys_and_no_dspark_keys"),
    m("Y3", "llama.cpp handed a DFlash2 draft as draft-dspark", "engines/llamacpp.py",
      [('return "draft-dflash" if config.family == "dflash2" else "draft-dspark"', 'return "draft-dspark"')],
      "test_dflash2_engines.py::test_each_engine_is_handed_the_draft_under_its_own_method"),
    m("Y4", "SGLang's DFLASH block given as N, not the anchor and N masks", "engines/sglang.py",
      [('"speculative_num_draft_tokens": block + 1}', '"speculative_num_draft_tokens": block}')],
      "test_dflash2_engines.py::test_each_engine_is_handed_the_draft_under_its_own_method"),
    m("Y5", "DSP062 (the lattice row wider than the hidden size) refused by every engine, not llama.cpp alone",
      "engines/llamacpp.py", [('OWN_CODES = frozenset({"DSP012", "DSP062"})', 'OWN_CODES = frozenset({"DSP012"})')],
      "test_dflash2_engines.py::test_a_lattice_wider_than_the_hidden_size_blocks_llamacpp_only"),
    m("Y6", "a DFlash2DraftModel config without sample_from_anchor read in the N-query layout (one draft too many)",
      "checkpoint/config.py",
      [('"DFlashQwen3Model", "DFlash2DraftModel"}', '"DFlashQwen3Model"}')],
      "test_dflash2_engines.py::test_each_engine_is_handed_the_draft_under_its_own_method"),
    m("Y7", "TensorRT-LLM's verdict on a DFlash2 draft the generic no-Markov-head one (DSP711), not DSP741",
      "engines/trtllm.py", [('    if config.family == "dflash2":\n        findings.append(engine_finding("DSP741"',
                             '    if False:\n        findings.append(engine_finding("DSP741"')],
      "test_dflash2_engines.py::test_validate_engine_all_verdicts"),
    # quantized GGUFs and the acceptance guard (Q1-): convert --outtype
    m("Q1", "Q8_0 blocks of 16 values, not 32", "convert/gguf_quant.py",
      [("reshape(-1, QK)  # [B, 32]\n    d = np.abs(blocks).max(axis=1) / np.float32(127)",
        "reshape(-1, QK // 2)  # [B, 32]\n    d = np.abs(blocks).max(axis=1) / np.float32(127)")],
      "test_gguf_quant.py::test_blocks_equal_the_gguf_reference_quantizer"),
    m("Q2", "the guard measures the quantized draft as its own reference", "bench/quant_guard.py",
      [('reference = measure_pair(settings, unquantized, "unquantized")',
        'reference = measure_pair(settings, quantized, "unquantized")')],
      "test_quant_guard.py::test_the_guard_measures_the_unquantized_draft_as_its_reference"),
    m("Q3", "output.weight (the lm_head) quantized when the user kept it", "convert/gguf_quant.py",
      [('if keep_output and name == "output.weight":', 'if keep_output and name == "lm_head.weight":')],
      "test_gguf_quant.py::test_leave_output_keeps_the_lm_head"),
    m("Q4", "Q8_0 rounds halves to even (numpy's round), not away from zero (C's roundf)", "convert/gguf_quant.py",
      [("quants = (whole + np.sign(scaled) * (np.abs(scaled - whole) >= 0.5)).astype(np.int8)",
        "quants = np.round(scaled).astype(np.int8)")],
      "test_gguf_quant.py::test_blocks_equal_the_gguf_reference_quantizer"),
    m("Q5", "Q4_0's scale from the last of equal magnitudes, not the first", "convert/gguf_quant.py",
      [("first_largest = np.abs(blocks).argmax(axis=1)", "first_largest = QK - 1 - np.abs(blocks[:, ::-1]).argmax(axis=1)")],
      "test_gguf_quant.py::test_blocks_equal_the_gguf_reference_quantizer"),
    m("Q6", "a one-row tensor (conf_proj.weight, [hidden + rank, 1]) quantized", "convert/gguf_quant.py",
      [("if all(size == 1 for size in ggml_shape[1:]):", "if len(ggml_shape) < 2:")],
      "test_gguf_quant.py::test_which_tensors_are_quantized"),
    m("Q7", "the guard passes a drop above the threshold", "bench/quant_guard.py",
      [("drop.estimate <= settings.max_tau_drop", "drop.estimate <= settings.max_tau_drop + 1")],
      "test_quant_guard.py::test_a_drop_beyond_the_threshold_is_refused_with_both_figures"),
    m("Q8", "the Q4_K super-block scale d = max / 62, not max / 63 (off by one)", "convert/gguf_kquant.py",
      [("d = (max_scale / f32(63)).astype(np.float16)", "d = (max_scale / f32(62)).astype(np.float16)")],
      "test_gguf_quant.py::test_q4_k_reproduces_values_on_its_grid"),
    m("Q9", "Q4_K's scale search keeps its first offset instead of moving it (ggml's make_qkx2_quants)",
      "convert/gguf_kquant.py",
      [("(x - offset[:, None])), 0, 15)", "(x - lowest[:, None])), 0, 15)")],
      "test_gguf_quant.py::test_files_equal_llama_quantize_pure"),
    # issue 37 (trust, round 5), class 3: what each engine loads, one rule per engine for validate, serve and convert
    # (K1-K11); class 4: drafts for every Gemma-4 target (J1-J4)
    m("K1", "llama.cpp's verdict not using the converter's confidence rule", "engines/llamacpp.py",
      [("confidence = conf_proj_refusal(config, config.enable_confidence_head)", "confidence = None")],
      "test_engine_loads.py::test_llamacpp_verdict_and_the_gguf_converter_apply_one_confidence_rule"),
    m("K2", "the confidence rule taking a head that reads the hidden state alone", "engines/llamacpp.py",
      [("if has_confidence and not (config.has_markov and config.confidence_head_with_markov):",
        "if has_confidence and not config.has_markov:")],
      "test_engine_loads.py::test_llamacpp_verdict_and_the_gguf_converter_apply_one_confidence_rule"),
    m("K3", "serve llamacpp accepting a threshold for a draft without a confidence head", "engines/llamacpp.py",
      [("    refuse_threshold_without_head(config, request)\n", "")],
      "test_engine_loads.py::test_llamacpp_serve_refuses_what_llama_server_would_drop_or_fail_on"),
    m("K4", "serve llamacpp dropping --calibration", "engines/llamacpp.py",
      [("    if request.calibration is not None:\n        raise DsparkError(\"llama.cpp reads no STS",
        "    if False:\n        raise DsparkError(\"llama.cpp reads no STS")],
      "test_engine_loads.py::test_llamacpp_serve_refuses_what_llama_server_would_drop_or_fail_on"),
    m("K5", "serve llamacpp accepting a probabilistic draft sample method", "engines/llamacpp.py",
      [('not in (None, "greedy"):', 'not in (None, "greedy", "probabilistic"):')],
      "test_engine_loads.py::test_llamacpp_serve_refuses_what_llama_server_would_drop_or_fail_on"),
    m("K6", "SGLang serving a Markov head type it does not build", "engines/sglang.py",
      [('    return head_type_finding(ENGINE, config, "DSP725"', '    return [] if True else head_type_finding(ENGINE, '
        'config, "DSP725"')],
      "test_engine_loads.py::test_each_engine_refuses_the_markov_heads_its_loader_does_not_build"),
    m("K7", "SGLang serving markov_rank > 0 without markov_head_type (dspark's vanilla default)", "engines/sglang.py",
      [("if config.has_markov and head_type_read(config.raw) is None:", "if False:")],
      "test_engine_loads.py::test_each_engine_refuses_the_markov_heads_its_loader_does_not_build"),
    m("K8", "TensorRT-LLM serving a Markov head type it does not build", "engines/trtllm.py",
      [("    findings += head_type_finding(ENGINE, config, \"DSP726\"",
        "    _ = head_type_finding(ENGINE, config, \"DSP726\"")],
      "test_engine_loads.py::test_each_engine_refuses_the_markov_heads_its_loader_does_not_build"),
    m("K9", "serve sglang passing any --calibration file as the STS path", "engines/sglang.py",
      [("= sts_file(request.calibration, pair.config, block)", "= request.calibration")],
      "test_engine_loads.py::test_sglang_takes_only_an_sts_file_it_reads_for_a_head_that_uses_it"),
    m("K10", "a do-not-speculate plan dropping the draft's options silently", "../cli/serve.py",
      [("        refuse_draft_options(from_plan, draft_topk", "        (lambda *a, **k: None)(from_plan, draft_topk")],
      "test_engine_loads.py::test_a_plan_that_says_do_not_speculate_refuses_the_options_of_the_draft"),
    m("K11", "vLLM taking a threshold for a Gemma-4 draft whose confidence head its loader skips", "engines/vllm.py",
      [('and "DSP043" in pair.report.codes:', 'and "DSP043" in pair.report.codes and False:')],
      "test_engine_loads.py::test_vllm_refuses_a_threshold_its_gemma4_loader_could_not_apply"),
    m("J1", "a Gemma-4 draft config inheriting hidden_size_per_layer_input", "checkpoint/families/gemma4.py",
      [('    "hidden_size_per_layer_input": 0,  # per-layer input embeddings (E2B / E4B)\n', "")],
      "test_train_families.py::test_every_gemma4_variant_gets_a_draft_validate_vllm_and_generate_accept"
      "[per-layer-inputs]"),
    m("J2", "a Gemma-4 draft config inheriting MoE blocks", "checkpoint/families/gemma4.py",
      [('    "enable_moe_block": False,  # MoE blocks (the 26B-A4B kind)\n', "")],
      "test_train_families.py::test_every_gemma4_variant_gets_a_draft_validate_vllm_and_generate_accept[moe]"),
    m("J3", "a Gemma-4 draft config inheriting num_kv_shared_layers", "checkpoint/families/gemma4.py",
      [("    \"num_kv_shared_layers\": 0,  # the last layers reuse", "    \"_\": 0,  # the last layers reuse")],
      "test_train_families.py::test_every_gemma4_variant_gets_a_draft_validate_vllm_and_generate_accept"
      "[kv-shared]"),
    m("J4", "prefill with an int logits_to_keep on a target whose captured layer shares K/V", "model/target.py",
      [("logits_to_keep=self._last_position(len(prompt_ids))", "logits_to_keep=1")],
      "test_train_families.py::test_every_gemma4_variant_gets_a_draft_validate_vllm_and_generate_accept"
      "[kv-shared]"),
    # issue 36 (A1-A5): bench audit, a live engine's speculative output against its plain output
    m("A1", "the audit compares only the first 8 generated tokens", "bench/audit.py",
      [("for position, (a, b) in enumerate(zip(ours, theirs)):",
        "for position, (a, b) in enumerate(zip(ours[:8], theirs[:8])):")],
      "test_audit.py::test_a_token_changed_after_the_first_block_is_found_where_it_is"),
    m("A2", "the T > 0 check samples the plain server for both sides", "bench/audit.py",
      [("drawn[role] = sample_tokens(servers[role], context,", "drawn[role] = sample_tokens(servers[\"plain\"], context,")],
      "test_audit.py::test_the_distribution_check_passes_for_one_sampler_and_fails_for_a_dropped_top_p"),
    m("A3", "a difference passed over as a near tie whatever the reference's margin", "bench/audit.py",
      [("    if max(margins) > tie_margin:\n", "    if max(margins) > float(\"inf\"):\n")],
      "test_audit.py::test_a_near_tie_of_the_reference_is_passed_over_and_a_clear_difference_is_not"),
    m("A4", "a prompt whose drafts were all rejected called identical, not inconclusive", "bench/audit.py",
      [("if self.drafted == 0 or self.accepted == 0 or", "if self.drafted == 0 or")],
      "test_audit.py::test_a_drafter_that_accepts_nothing_is_inconclusive_but_a_difference_still_differs"),
    m("A5", "both servers sampled with the same seeds (the two samples not independent)", "bench/audit.py",
      [("return [(base + 2 * i + side) % SEED_LIMIT", "return [(base + 2 * i) % SEED_LIMIT")],
      "test_audit.py::test_the_distribution_check_passes_for_one_sampler_and_fails_for_a_dropped_top_p"),
    m("F1", "DFlash2's convolution window one position late (tap t reads q - t - 1)", "model/families/dflash2.py",
      [("earlier = F.pad(y[:, : L - tap], (0, 0, tap, 0))", "earlier = F.pad(y[:, : L - tap - 1], (0, 0, tap + 1, 0))")],
      "test_dflash2.py::test_grouped_conv_equals_the_reference"),
    m("F2", "the selector's pairwise term dropped (scores = the candidates' logits)", "model/selector.py",
    # validate on GGUF files, the silent-degradation rules and the probe (R1-): tests/fixtures/misexport.py's corpus
    m("R1", "validate's GGUF reader skips the +1 on layer ids", "checkpoint/gguf_read.py",
      [("return [k - 1 for k in llamacpp_ids]", "return list(llamacpp_ids)")],
      "test_validate_gguf.py::test_gguf_layer_ids_are_deepspec_ids_plus_one"),
    m("R2", "the probe reads τ from the mean proposed length", "probe.py",
      [("block_size=pair.block_size, tau=summary.tau,", "block_size=pair.block_size, tau=summary.mean_proposed,")],
      "test_probe.py::test_demo_draft_is_not_flagged_and_tau_is_tokens_per_round"),
    m("R3", "the probe reads τ from the draft acceptance rate", "probe.py",
      [("block_size=pair.block_size, tau=summary.tau,",
        "block_size=pair.block_size, tau=summary.draft_acceptance_rate,")],
      "test_probe.py::test_demo_draft_is_not_flagged_and_tau_is_tokens_per_round"),
    m("R4", "untrained norms: only all-ones caught, not zero spread", "checkpoint/rules/deep.py",
      [("if len(values) < 2 or len(set(values)) != 1:", "if len(values) < 2 or set(values) != {1.0}:")],
      "test_validate_gguf.py::test_misexported_folder_is_flagged"),
    m("R5", "a GGUF without dflash.block_size read as llama.cpp's default 16 and passed", "checkpoint/rules/gguf.py",
      [("out, value = Results(), draft.file.key(\"block_size\")",
        "out, value = Results(), draft.file.key(\"block_size\") or 16")],
      "test_validate_gguf.py::test_misexported_gguf_is_flagged"),
    m("R6", "the GGUF vocabulary compared by count only", "checkpoint/rules/gguf.py",
      [("differ = [i for i, token in target.tokens.items() if i < len(tokens) and tokens[i] != token]",
        "differ = []")],
      "test_validate_gguf.py::test_misexported_gguf_is_flagged"),
    m("R7", "convert drops the window keys (a window-trained draft runs dense)", "convert/gguf.py",
      [("    if window is not None:\n        writer.add_uint32", "    if False:\n        writer.add_uint32")],
      "test_validate_gguf.py::test_convert_writes_the_window_keys"),
      [("return unary.float()[..., None, :] + self.pairwise(hidden, predecessors, ids)",
        "return unary.float()[..., None, :] + 0 * self.pairwise(hidden, predecessors, ids)")],
      "test_dflash2.py::test_selector_scores_equal_the_formula"),
    m("F3", "the convolution's group size read as its kernel size", "model/families/dflash2.py",
      [("K, config.conv_group_size, H // config.conv_group_size", "K, config.conv_kernel_size, H // config.conv_kernel_size")],
      "test_dflash2.py::test_grouped_conv_equals_the_reference"),
    m("F4", "the checkpoint's conv_group_size read from conv_kernel_size", "checkpoint/families/dflash2.py",
      [("**{key: _positive(dflash.get(key)) for key in KEYS},",
        "**{key: _positive(dflash.get(key)) for key in KEYS}, \"conv_group_size\": _positive(dflash.get(\"conv_kernel_size\")),")],
      "test_dflash2.py::test_a_dflash2_draft_validates_clean"),
    m("F5", "the selector walk never moves off the first predecessor row", "decode/selector.py",
      [("previous = (ids[:, j] == tokens[:, j, None]).long().argmax(-1)  # [B]", "previous = previous  # [B]")],
      "test_dflash2.py::test_greedy_walk_equals_the_lattice_walk"),
    m("F6", "training's slot-1 predecessor not the anchor (DFlash layout off by one)", "train/loss.py",
      [("        prev_ids[..., 1] = anchor_ids  # slot 0 has no label: slot 1's predecessor is the anchor\n", "")],
      "test_dflash2.py::test_teacher_forced_logits_are_the_walk_rows_on_the_candidates"),
    m("F7", "DFlash2's q at T > 0 from the base logits, not the realized selector row", "decode/speculative.py",
      [("draft_probs = None if params.greedy else sampling.target_probs(walk.rows[0], params)  # [N, V]",
        "draft_probs = None if params.greedy else sampling.target_probs(base, params)  # [N, V]")],
      "test_speculative_lossless.py::test_dflash2_emitted_tokens_follow_the_target_distribution"),
    m("F8", "the selector's confidence the top-1 share's complement", "decode/selector.py",
      [("return -torch.logsumexp(others, dim=-1)", "return torch.logsumexp(others, dim=-1)")],
      "test_dflash2.py::test_greedy_walk_equals_the_lattice_walk"),
    # issue 36 (X1-X5): bench audit, a live engine's speculative output against its plain output
    m("X1", "the audit compares only the first 8 generated tokens", "bench/audit.py",
      [("for position, (a, b) in enumerate(zip(ours, theirs)):",
        "for position, (a, b) in enumerate(zip(ours[:8], theirs[:8])):")],
      "test_audit.py::test_a_token_changed_after_the_first_block_is_found_where_it_is"),
    m("X2", "the T > 0 check samples the plain server for both sides", "bench/audit.py",
      [("drawn[role] = sample_tokens(servers[role], context,", "drawn[role] = sample_tokens(servers[\"plain\"], context,")],
      "test_audit.py::test_the_distribution_check_passes_for_one_sampler_and_fails_for_a_dropped_top_p"),
    m("X3", "a difference passed over as a near tie whatever the reference's margin", "bench/audit.py",
      [("    if max(margins) > tie_margin:\n", "    if max(margins) > float(\"inf\"):\n")],
      "test_audit.py::test_a_near_tie_of_the_reference_is_passed_over_and_a_clear_difference_is_not"),
    m("X4", "a prompt whose drafts were all rejected called identical, not inconclusive", "bench/audit.py",
      [("if self.drafted == 0 or self.accepted == 0 or", "if self.drafted == 0 or")],
      "test_audit.py::test_a_drafter_that_accepts_nothing_is_inconclusive_but_a_difference_still_differs"),
    m("X5", "both servers sampled with the same seeds (the two samples not independent)", "bench/audit.py",
      [("return [(base + 2 * i + side) % SEED_LIMIT", "return [(base + 2 * i) % SEED_LIMIT")],
      "test_audit.py::test_the_distribution_check_passes_for_one_sampler_and_fails_for_a_dropped_top_p"),
]


def run(mutation: Mutation, copy: Path) -> str:
    path = copy / mutation.file
    original = path.read_text()
    text = original
    for old, new in mutation.edits:
        if text.count(old) != 1:
            return f"STALE ({old[:40]!r} found {text.count(old)} times)"
        text = text.replace(old, new)
    path.write_text(text)
    try:
        env = dict(os.environ, PYTHONPATH=str(copy / "src"), HF_HUB_OFFLINE="1")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 *mutation.tests], cwd=copy, env=env, capture_output=True, text=True)
        if result.returncode == 0:
            return "MISSED"
        failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        if not failed:
            return f"CAUGHT (pytest exited {result.returncode})"
        return f"CAUGHT by {failed[0].split(' - ')[0].split(' ', 1)[1]}"
    finally:
        path.write_text(original)


def main(ids: list[str]) -> int:
    chosen = [mu for mu in MUTATIONS if not ids or mu.id in ids]
    with tempfile.TemporaryDirectory(prefix="dspark-mutations-") as tmp:
        copy = Path(tmp)
        for part in ("src", "tests", "docs", "scripts", "pyproject.toml", "README.md"):
            source = ROOT / part
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, copy / part)
        caught = 0
        for mutation in chosen:
            outcome = run(mutation, copy)
            caught += outcome.startswith("CAUGHT")
            print(f"{mutation.id:4} {mutation.what}: {outcome}", flush=True)
    print(f"{caught}/{len(chosen)} caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
