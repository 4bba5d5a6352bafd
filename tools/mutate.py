"""
Mutation check: does each test catch the bug its name claims? Not part of the test suite (CI never runs it).

    python tools/mutate.py              # every mutation below; exit 1 if one is missed or its snippet is stale
    python tools/mutate.py --list       # the mutations, one a line
    python tools/mutate.py v2_eps_zero  # only the named ones

Each MUTATIONS entry puts one deliberate bug into a copy of the repository (the tracked and untracked, not ignored
files, copied once to a temporary folder): in `file` the snippet `old`, which must occur exactly once, becomes
`new`; then `python -m pytest -x -q` runs the named `tests` there on one thread. A mutation is caught when pytest
reports a failing test (exit 1); passing (exit 0) is a miss, anything else (collection error, no such test) an
error. The named tests are first run on the unchanged copy, which must pass. When code moves, only `file`,
`old` (keep it short and distinctive) and the test node ids need retargeting.
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, old, new, the tests that must catch it, ...)
MUTATIONS = [
    # --- the bugs that the suite once missed or caught only by luck -------------------------------------------
    ("v2_eps_zero", "losses.py", "def sddlm_v2_loss(logits, x0, xt, eps=EPS):",
     "def sddlm_v2_loss(logits, x0, xt, eps=0.0):", "test_losses.py::test_default_eps_is_used_by_sddlm_v1_and_v2"),
    ("final_ancestral_step_noop", "sample.py", "x = step(x, alphas[-1], 1.0)", "x = x",
     "tests/test_sample.py::test_final_ancestral_step_alone_lands_on_x0_from_large_t"),
    ("resume_forgets_gen_local", "plumbing/checkpoint.py", 'run.gen_local.set_state(r["gen_local"])', "pass",
     "tests/test_train.py::test_resume_mid_curriculum_continues_bit_identically"),
    ("model_fed_alpha_not_sigma", "diffusion.py", "out = model(c.net_in, sigma_from_alpha(c.alpha_t.squeeze(-1)),",
     "out = model(c.net_in, c.alpha_t.squeeze(-1),",
     "tests/test_train.py::test_training_conditions_the_model_on_minus_log_alpha_t"),
    ("v1_negatives_are_replacement_tokens", "diffusion.py", "return Corrupted(x0, xt, net_in, draws[2],",
     "return Corrupted(x0, xt, net_in, draws[1],",
     "tests/test_train.py::test_sddlm_v1_negatives_are_uniform_and_independent_of_xt"),
    # --- the loosely checked paths ------------------------------------------------------------------------------
    ("nelbo_pooling_ignores_mask", "metrics.py", "nats[k] += (w[h] * (per_token.double() * mask).sum(1)).cpu()",
     "nats[k] += (w[h] * per_token.double().sum(1)).cpu()",
     "tests/test_eval_ppl.py::test_nelbo_ppl_is_exp_of_the_printed_token_mean_nelbo"),
    ("nelbo_strata_weighed_by_width", "metrics.py", "w[0] = t[0] * torch.log(b[0] / a[0]) / (1 - t_min)",
     "w[0] = (b[0] - a[0]) / (1 - t_min)",
     "tests/test_eval_ppl.py::test_stratified_times_cover_strata_and_are_unbiased"),
    ("nelbo_draws_belong_to_the_batch_row", "metrics.py", "sequence_draws(seed, first + b, rnd,",
     "sequence_draws(seed, b, rnd,", "tests/test_eval_ppl.py::test_nelbo_draws_belong_to_the_sequence_not_the_batch"),
    ("nelbo_se_of_one_round_not_the_mean", "metrics.py", "var = nats.var(0, unbiased=True) / R",
     "var = nats.var(0, unbiased=True)", "tests/test_eval_ppl.py::test_nelbo_standard_error_is_the_spread_over_seeds"),
    ("nelbo_eval_feeds_alpha_not_sigma", "metrics.py",
     "logits = model(xt, diffusion.sigma_from_alpha(alpha_t.squeeze(-1)))", "logits = model(xt, alpha_t.squeeze(-1))",
     "tests/test_eval_ppl.py::test_nelbo_ppl_is_exp_of_the_printed_token_mean_nelbo"),
    ("replacement_never_redraws_x0", "diffusion.py", "device=x0.device), x0, noise)",
     "device=x0.device), x0, (x0 + 1 + noise % (vocab_size - 1)) % vocab_size)",
     "tests/test_eval_downstream.py::test_continuation_tokens_survive_with_alpha_t_plus_uniform",
     "tests/test_diffusion.py::test_sample_xt_frequencies_match_discrete_marginal"),
    ("training_detached_from_the_model", "train.py",
     "loss = diffusion.token_mean(*per_token_loss(run.model, x0, mask, t, draws)) / cfg.grad_accum",
     "loss = diffusion.token_mean(*per_token_loss(run.model, x0, mask, t, draws)).detach().requires_grad_()"
     " / cfg.grad_accum",
     "tests/test_train.py::test_every_loss_trains_and_its_loss_goes_down"),
    # --- the float tolerances: derived from rounding, still tight enough to catch (tests/conftest.py) -------------
    ("micro_batches_share_the_first_draws", "plumbing/distributed.py",
     "rank_slice(v, self.rank, self.world_size, m, cfg.grad_accum)",
     "rank_slice(v, self.rank, self.world_size, 0, cfg.grad_accum)",
     "tests/test_train.py::test_grad_accumulation_matches_one_big_batch"),
    ("micro_batch_loss_not_divided_by_grad_accum", "train.py",
     "loss = diffusion.token_mean(*per_token_loss(run.model, x0, mask, t, draws)) / cfg.grad_accum",
     "loss = diffusion.token_mean(*per_token_loss(run.model, x0, mask, t, draws))",
     "tests/test_train.py::test_grad_accumulation_matches_one_big_batch"),
    ("ema_warmup_decay_off_by_one", "train.py", "d = min(cfg.ema, (1 + n_ema) / (10 + n_ema))",
     "d = min(cfg.ema, (2 + n_ema) / (11 + n_ema))",
     "tests/test_move_fixture.py::test_steps_weights_and_sample_match_the_recording"),
    # --- equations: losses, forward process, posterior, sampler ---------------------------------------------------
    ("v1_eps_on_one_term_only", "losses.py", "- log_p_plus_eps(log_p_x0, eps))", "- log_p_x0)",
     "test_losses.py::test_sddlm_v1_matches_negative_sampling_with_eps_on_both"),
    ("sddlm_scores_kept_tokens", "losses.py", "return -log_probs(logits, x0)[0] * (xt != x0)",
     "return -log_probs(logits, x0)[0] * (xt == x0)",
     "test_losses.py::test_sddlm_loss_is_cross_entropy_on_replaced_tokens_only"),
    ("nelbo_drops_r_minus_1_minus_log_r", "losses.py", "r_term = torch.expm1(log_r) - log_r",
     "r_term = torch.zeros_like(log_r)", "test_losses.py::test_usdm_nelbo_matches_printed_formula_with_duo_sign"),
    ("nelbo_kl_not_divided_by_K", "losses.py", "return -dalpha_t / (alpha_t * x_bar_z) * (r_term + kl / K)",
     "return -dalpha_t / (alpha_t * x_bar_z) * (r_term + kl)",
     "test_losses.py::test_usdm_nelbo_matches_printed_formula_with_duo_sign"),
    ("bf16_logit_gradient_rounded_twice", "losses.py", "return torch.log_softmax(z, dim=-1).gather(-1, tokens)",
     "return (logits.gather(-1, tokens).to(z.dtype) - torch.logsumexp(z, dim=-1, keepdim=True))",
     "test_losses.py::test_bf16_logits_are_scored_in_float32_in_chunks_of_rows",
     "test_losses.py::test_sddlm_target_logit_gradient_is_rounded_once_in_bf16"),
    # --- the fused head: kept logits, W's gradient summed in float32 -----------------------------------------------
    ("fused_head_never_keeps_its_logits", "kernels/fused_head.py", "keep = (keep or len(chunks) == 1) and",
     "keep = (len(chunks) == 1) and",
     "tests/test_fused_head.py::test_kept_logits_cost_three_products_and_recomputed_four"),
    ("w_gradient_summed_through_bf16", "kernels/fused_head.py", "a, b = a.to(acc.dtype), b.to(acc.dtype)",
     "a, b = (a @ b).to(acc.dtype), torch.eye(b.shape[-1], dtype=acc.dtype, device=acc.device)",
     "tests/test_fused_head.py::test_w_gradient_is_summed_over_chunks_in_float32"),
    ("posterior_uniform_share_uses_alpha_t", "diffusion.py", "(1 - a_t / a_s) * (1 - a_s) / Z, (K * a_t",
     "(1 - a_t / a_s) * (1 - a_t) / Z, (K * a_t", "tests/test_diffusion.py::test_reverse_posterior_matches_bayes_rule"),
    ("posterior_stay_weight_drops_a_ts_minus_a_t", "diffusion.py", "(K * a_t * x0_at_xt + a_t / a_s - a_t) / Z",
     "(K * a_t * x0_at_xt) / Z", "tests/test_diffusion.py::test_posterior_weights_are_bayes_rule_in_float64"),
    ("ancestral_mixture_uniform_weight", "diffusion.py", "(a_s - a_t) / Z, (1 - a_t / a_s) * (1 - a_s) / Z",
     "(a_s - a_t) / Z, (1 - a_t / a_s) / Z",
     "tests/test_diffusion.py::test_ancestral_step_frequencies_match_reverse_posterior"),
    ("psi_corrector_keeps_xt_unrenoised", "diffusion.py",
     "return a_s * (1 - a_t) / Z, (1 - a_s) * torch.ones_like(p_z)", "return (1 - a_t) / Z, 0 * p_z",
     "tests/test_diffusion.py::test_psi_step_frequencies_match_kappa_predictor_corrector",
     "tests/test_diffusion.py::test_psi_corrector_is_posterior_to_level_zero_renoised_to_s"),
    ("top_k_tokens_in_drawing_order", "curriculum/gaussian.py", "dtype=torch.float64).argsort(-1)",
     "dtype=torch.float64).argsort(-1).sort(-1).values",
     "tests/test_diffusion.py::test_top_k_latent_has_the_joint_law_of_the_dense_top_k"),
    ("times_not_stratified", "diffusion.py", "e = (u + torch.arange(n, device=device)) / n", "e = u",
     "tests/test_diffusion.py::test_sample_t_is_stratified_over_the_global_batch",
     "tests/test_train.py::test_training_conditions_the_model_on_minus_log_alpha_t"),
    ("resume_forgets_gen_shared", "plumbing/checkpoint.py", 'run.gen_shared.set_state(r["gen_shared"])', "pass",
     "tests/test_train.py::test_resume_continues_bit_identically"),
    # --- reliability: inputs never overwritten, one run per folder, every stop signal -------------------------
    ("users_file_replaced", "plumbing/files.py", "    elif os.path.lexists(path):\n        writer = writer_of(path)",
     "    elif False:\n        writer = writer_of(path)",
     "tests/test_files.py::test_an_output_is_new_or_a_regular_file_sddlm_wrote"),
    ("another_scripts_output_replaced", "plumbing/files.py", "if script is not None and writer != signature(script):",
     "if False:", "tests/test_files.py::test_an_output_replaces_only_its_own_scripts_earlier_output"),
    ("lock_file_written_through", "plumbing/lock.py",
     "if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode) or _lock_record(fd) is None:", "if False:",
     "tests/test_lock.py::test_locks_never_write_through_nor_replace_a_users_file"),
    ("zip_crc_unchecked", "plumbing/integrity.py", "zlib.crc32(view[start:start + info.compress_size]) == info.CRC",
     "True", "tests/test_integrity.py::test_the_zip_crc_finds_one_flipped_bit"),
    ("nan_weights_pass", "plumbing/integrity.py", "if not (math.isfinite(low) and math.isfinite(high)):", "if False:",
     "tests/test_integrity.py::test_weights_must_be_finite_floats"),
    ("incomplete_launch_env_passes", "plumbing/distributed.py", "        if missing:\n            fail(",
     "        if False:\n            fail(",
     "tests/test_distributed.py::test_the_launch_environment_is_checked_as_a_whole"),
    ("output_over_input_allowed", "plumbing/files.py", "same = out_real == in_real or", "same = False and",
     "tests/test_files.py::test_an_output_that_resolves_to_an_input_is_refused"),
    ("out_dir_lock_not_exclusive", "plumbing/lock.py", "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
     "tests/test_lock.py::test_a_held_folder_names_its_holder_a_dead_ones_is_taken"),
    ("only_sigint_sigterm_handled", "plumbing/cli.py",
     '("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")', '("SIGINT", "SIGTERM")',
     "tests/test_signals.py::test_every_stop_signal_ends_a_script_in_one_line_and_130"),
    ("diverged_loss_not_checked", "plumbing/run.py", 'why = "non-finite loss" if bad else self.rule.check(',
     "why = None and self.rule.check(",
     "tests/test_train.py::test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint"),
    ("preset_curriculum_not_its_share", "train.py",
     "cfg.curriculum_iters = round(cfg.curriculum_share * cfg.max_iters)", "pass",
     "tests/test_train.py::test_a_presets_curriculum_keeps_its_share_and_on_resume"),
    ("resume_of_the_other_scripts_folder", "plumbing/checkpoint.py", "if writer is None or writer == script:",
     "if True:", "tests/test_checkpoint.py::test_resume_refuses_the_other_scripts_folder"),
    # --- fine-tuning: train.py --init SOURCE ------------------------------------------------------------------------
    ("finetune_ema_starts_at_random_weights", "trained/finetune.py", "e.copy_(p.detach())", "pass",
     "tests/test_finetune.py::test_a_run_from_a_checkpoint_starts_at_its_validation"),
    ("finetune_resume_forgets_its_source", "trained/finetune.py", "resumed_source(cfg.out_dir) if cfg.resume",
     "None if cfg.resume", "tests/test_finetune.py::test_a_resumed_fine_tuning_run_continues_bit_identically"),
    ("finetune_runs_the_presets_curriculum", "train.py", 'if cfg.init and "curriculum_share" not in given:',
     "if False:", "tests/test_finetune.py::test_the_curriculum_is_off_unless_asked_for"),
    # --- bench/bench.py: every row starts from the same memory (issue 36) -----------------------------------------
    ("bench_act_count_keeps_its_graph", "bench/bench.py", "            kept[s.data_ptr()] = s\n",
     "            kept[s.data_ptr()] = s\n        return x\n",
     "tests/test_bench.py::test_saved_activation_bytes_leaves_no_graph_behind"),
    ("bench_rows_never_collect_cycles", "bench/bench.py", "            gc.collect()        # reference cycles",
     "            pass                # reference cycles",
     "tests/test_bench.py::test_rows_free_what_a_measurement_left_naming_what_stays",
     "tests/test_bench.py::test_bench_prints_n_a_for_what_does_not_fit"),
    ("bench_tables_keep_the_alpha_tables", "bench/bench.py", "            curriculum.clear_alpha_tables()\n", "",
     "tests/test_bench.py::test_rows_free_what_a_measurement_left_naming_what_stays"),
    # --- long generation: the held context, the judge's windows --------------------------------------------------
    ("long_window_holds_the_tokens_one_back", "sample.py", "prompt_ids=x[:, x.shape[1] - held:] if held else None",
     "prompt_ids=torch.roll(x, 1, 1)[:, x.shape[1] - held:] if held else None",
     "tests/test_long_generation.py::test_held_context_is_the_previous_output_at_every_boundary",
     "tests/test_long_generation.py::test_exact_denoiser_continues_a_periodic_text_at_boundaries"),
    ("judge_window_one_token_of_context_short", "metrics.py", "windows.append((new_end - context, new_end, end))",
     "windows.append((new_end - context + 1, new_end, end))",
     "tests/test_eval_ppl.py::test_gen_ppl_past_the_judge_is_brute_force_per_token"),
]


def pytest(copy, tests):
    """-> (pytest's exit code, its last line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=copy,
                       env=env, capture_output=True, text=True)
    lines = [l for l in (r.stdout + r.stderr).strip().splitlines() if l.strip()]
    return r.returncode, lines[-1] if lines else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, file, _, _, *tests in MUTATIONS:
            print(f"{name:40s} {file:20s} {' '.join(tests)}")
        return 0
    unknown = sorted(set(args.names) - {m[0] for m in MUTATIONS})
    if unknown:
        print(f"unknown mutation(s) {', '.join(unknown)}; see --list", file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not args.names or m[0] in args.names]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="sddlm-mutate-") as copy:
        # the files a checkout carries: tracked ones and untracked ones git does not ignore
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        for f in listed.split("\0"):
            if f and os.path.isfile(os.path.join(ROOT, f)):
                os.makedirs(os.path.dirname(os.path.join(copy, f)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, f), os.path.join(copy, f))
        baseline = sorted({t for m in chosen for t in m[4:]})
        code, last = pytest(copy, baseline)
        print(f"{'baseline (unmutated)':40s} {'pass' if code == 0 else 'FAIL'}  {last}", flush=True)
        if code != 0:
            print("the named tests must pass on the unchanged code first", file=sys.stderr)
            return 1
        for name, file, old, new, *tests in chosen:
            path = pathlib.Path(copy, file)
            source = path.read_text() if path.exists() else ""
            if (n := source.count(old)) != 1:
                print(f"{name:40s} STALE   {file}: snippet found {n} times (must be once): {old!r}")
                bad += 1
                continue
            start = time.time()
            path.write_text(source.replace(old, new))
            try:
                code, last = pytest(copy, tests)
            finally:
                path.write_text(source)
            verdict = {0: "MISSED", 1: "caught"}.get(code, f"ERROR({code})")
            bad += verdict != "caught"
            print(f"{name:40s} {verdict:7s} {time.time() - start:5.1f}s  {last}", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
