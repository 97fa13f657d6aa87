"""Render docs/measurements.md and the README's demo result from experiments/results/*.json (each
result's own Markdown: :mod:`experiments.renderers`).

    python -m experiments.readme_tables [--write]

Only result files written on a clean tree are quoted (``experiments.common.is_clean``: the file
records a commit and ``dirty: false``; scale-plan cells each record their own), and only while the
code they measure is unchanged since that commit (``experiments.freshness``). A file without that
record, written with uncommitted changes, or stale, gets a line saying which command to re-run
instead of its table. ``--write`` finds the stale ones with git and keeps the answer in
experiments/results/stale.json, so the pages render from files alone (a clone without history
renders them the same). Speed ratios against a peer are shown only for decodes that produced the
peer's tokens, and metrics that replay forces to zero (disagreement of the routes *used*) are left out.
``--write`` rewrites docs/measurements.md and the blocks between ``<!-- NAME -->`` / ``<!-- /NAME -->``
markers in README.md and docs/testing.md; without it the Markdown is printed.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from experiments.common import RESULTS, is_clean, table
from experiments.renderers import (async_rl, bench_attention, bench_decode, bench_dp, bench_dtype, bench_engine,
                                  bench_ep, bench_logits, bench_model, bench_multiprocess, bench_paged, bench_scan,
                                  bench_serve, bench_step, bench_trace, bench_weight_sync, decode_bytes, demo, interop,
                                  learn_pilot, load, replay_dose, replay_learn, replay_mismatch, replay_rl, routers,
                                  serve_start, suite_time, transfer_cost)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MEASUREMENTS = ROOT / "docs" / "measurements.md"
STALE = "stale"  # experiments/results/stale.json: what --write found stale (experiments/freshness.py)
TESTING = ROOT / "docs" / "testing.md"


@dataclass(frozen=True)
class Section:
    name: str            # experiments/results/<name>.json
    title: str
    command: str
    about: str
    render: Callable[[dict], str]

    @property
    def module(self) -> str:
        """The experiment module that writes this result (``experiments/<module>.py``)."""
        word = self.command.split()[2] if self.command.startswith("python -m ") else self.command.split()[-1]
        return word.removeprefix("experiments.").replace("-", "_")


SECTIONS = [
    Section("demo_summary", "The demo: multi-turn RL with and without replay", "python -m experiments.train_multiturn",
            "`make demo`'s run (tiny model, bf16 rollouts over HTTP, fp32 trainer, with and without replay from "
            "one warm start), published with its commit. Mean ± 95% CI half-width over seeds; reward_first / "
            "reward_last: mean over the first / last quarter of the steps.",
            lambda d: demo(d) + "\n\n![demo](../experiments/results/demo.png)"),
    Section("learn_pilot", "Pilots of a testbed where RL learns", "python -m experiments.learn_pilot",
            "The demo's task and model without replay, 5 seeds per setting (in-process engine, bf16 rollouts, "
            "a supervised warm start shared by the seeds). reward_gain: per seed, the training reward over the "
            "last quarter of the steps minus the first quarter (mean ± 95% CI over seeds; the testbed needs >= 0.1 "
            "with the CI above 0); eval_*: greedy reward on 16 held-out environments after step 1 and after the "
            "last; live_routing_disagreement: the trainer router's top-k against the rollout's (router noise makes "
            "it material). Settings that did not learn are listed too.", learn_pilot),
    Section("replay_learn", "Replay where RL learns: none, R2, R3, TIS, R3 + TIS and IcePop",
            "python -m experiments.replay_learn",
            "The learning testbed (the demo's echo task, tiny model, 30 GRPO steps at lr 1e-3 from a supervised "
            "warm start; in-process engine, bf16 rollouts, fp32 trainer) per setting and arm, 5 seeds paired "
            "across arms. Settings: bf16 rollouts alone, and simulated router noise σ = 0.25 on the rollout "
            "engine (material live disagreement). Mean ± 95% CI over seeds; comparisons: the paired difference "
            "of the last-quarter reward from no replay.",
            lambda d: replay_learn(d) + "\n\n![replay_learn](../experiments/results/replay_learn.png)"),
    Section("async_rl", "Synchronous and asynchronous RL, without and with replay", "python -m experiments.async_rl",
            "The learning testbed above, 30 steps, 3 seeds paired across cells. `sync` samples each step's rollouts "
            "on the previous step's weights; `async<K>` samples up to K steps ahead of the trainer in a thread, "
            "on the weights pushed so far (mode keep: a trajectory can span versions), so a trained token is at "
            "most K versions old; R3 replays each route row from the version that produced it. samples/s: "
            "trajectories per second after step 1 (its compiles left out); version lag: trainer version minus "
            "the version that sampled each trained token. On 2 CPU cores the sampler and the trainer share "
            "the cores, so the throughput gain is a lower bound; in this run a third process (a TPU compile) "
            "shared them throughout. Comparisons: paired against `sync`, same arm.",
            async_rl),
    Section("replay_rl", "Replay in RL: none, R2 and R3 with bf16 and int8 rollouts", "python -m experiments.replay_rl",
            "Seeds × {no replay, R2 (trainer routes), R3 (rollout routes)} × {bf16, int8 rollouts} from one "
            "warm start, PPO with two minibatch updates per batch, fp32 trainer, on a model with more experts "
            "(E = 64, top-8) so that the mismatch is material. Final reward: mean over the last quarter of the "
            "steps ± 95% CI over seeds; k3 KL and mean |Δ logprob| as median / p99 over all steps; a collapse "
            "is a reward below half its peak for 5 steps.", replay_rl),
    Section("replay_dose", "Where replay pays: outcome against train–rollout mismatch, per arm",
            "python -m experiments.replay_dose",
            "A resumable grid of GRPO runs (the replay_rl model: 4 MoE layers, E = 64, top-8) over mismatch "
            "settings × arms {none, R2, R3, TIS (cap 2, the ratio against the pre-update trainer logprobs), "
            "R3 + TIS} × seeds, paired over seeds; the steps, prompts and samples per step are in the "
            "command's defaults and the result file. A setting names "
            "its mismatch source (bf16 rollouts; `s<σ>`: *simulated* Gaussian noise of std σ on the rollout "
            "engine's router logits; int8 / fp8 weights; `sigmoid`: grouped sigmoid routing) and its off-policy "
            "degree (`mb<n>` minibatch updates per rollout batch, default 2; `ep<n>` epochs). Live disagreement: "
            "the trainer router's own top-k against the rollout's, in the first update of each batch. Final "
            "reward: mean of the last quarter of the steps ± 95% CI over seeds; p99 |log ratio|: median over "
            "steps of each step's p99 of |log π_train − log π_rollout| over targets. Only cells with every seed "
            "are quoted. The runs were made by two processes side by side on the 2 cores, so step seconds "
            "are under load; a time ratio pairs only runs of one commit.", replay_dose),
    Section("replay_mismatch", "Train–rollout mismatch with and without replay", "python -m experiments.replay_mismatch",
            "Random-init models; the engine samples in bf16 with its LM head in fp32 (its default), in bf16 with "
            "a bf16 head, and in fp32 (the same-dtype control); an fp32 trainer "
            "scores the same tokens with and without replay. `live_*`: the trainer router's own top-k against "
            "the rollout's. Replay overrides the choice, not the router; but replayed layers feed later layers "
            "hidden states closer to the rollout's, so their live choice moves too.",
            replay_mismatch),
    Section("routers", "Router families", "python -m experiments.routers",
            "bf16 engine rollouts scored by an fp32 trainer for each router family (softmax top-k; sigmoid with "
            "a selection bias and group limiting; the same with multi-head latent attention).", routers),
    Section("bench_model", "Model forward: replay overhead", "python -m experiments.bench_model",
            "time(forward with replay) ÷ time(live forward), same batch, same run.", bench_model),
    Section("bench_decode", "Decode", "python -m experiments.bench_decode",
            "Greedy decode with routes captured against Hugging Face transformers `generate` (torch, fp32) and "
            "Tunix 0.1.7's `Sampler` (peer config only, its own venv) on the same weights. `hf_same_tokens` / "
            "Tunix's: fraction of rows whose continuation equals ours token for token; a speed ratio is shown "
            "only where it is 1. Each side is sized for its batch (our engine: `max_batch_size` = B) and ours runs "
            "its default kernel (gather on CPU); our models run with unrolled layers on CPU, and the engine decodes "
            "8 steps per device call (`decode_steps`). Against the goals (≥ 1.5× HF at B = 8 and 32, ≥ 2× Tunix "
            "at B = 8, capture on ÷ off ≥ 0.95) on this CPU, in this run (the full one: 64 new tokens on the peer "
            "config, 128 on the others): the peer config is 2.44× HF at B = 8 and 1.43× at B = 32 (0.98× at "
            "B = 64) and 1.42× Tunix at B = 8 (5.64× at B = 1); tiny 5.96× and 2.71× (1.60× at B = 64); "
            "small_100m 2.24× and 1.72× (1.05× at B = 64); capture on ÷ off 0.98–1.03 (best runs; "
            "`capture_on_over_off_paired`, the median of back-to-back pairs, 0.94–1.11). The three runs before "
            "it, on the same decode path, gave the peer config 2.41× and 1.45× (1.42× Tunix), 2.47× and 1.57× "
            "(1.60× Tunix) and 2.34× and 1.44× (1.51× Tunix): at B = 32 the goal is within run-to-run noise. The `--quick` run at 6a871d9 (32 new "
            "tokens) gave the peer config 1.74× and 1.17× (1.74× Tunix): fewer tokens weigh the prefill and the "
            "first call more, ours more than HF's and less than Tunix's, whose sampler gains the most from a "
            "longer decode. Each figure is the best of its runs (ours 12 on tiny, 6 elsewhere; HF 4 and 2; "
            "Tunix 3), and on this loaded 2-core machine a side's tokens/s moves by up to 2.6× between runs. "
            "An engine of fewer than 12 requests "
            "prefills 4 prompts a step (`Engine.prefill_rows_for`), so B = 8 takes two prefill steps. "
            "[Where a decode step's time goes](#where-a-decode-steps-time-goes) breaks a call down.", bench_decode),
    Section("serve_start", "Server start, cold and on restart", "python -m experiments.serve_start",
            "`python -m r3jax serve --model tiny --port 0 --compilation-cache DIR` launched as a user would, "
            "timed from launch to the first `/health` 200 (`wall_s`; every program compiled or loaded): cold on "
            "an empty cache directory, then restarted on the one it filled. `ready_s` is the server's own count "
            "from its process start, `warmup_s` the warm-up alone; `compiled` / `loaded`: programs XLA compiled "
            "and programs the caches supplied (`/v1/stats` `warmup`). A restart loads the engine's serialized "
            "programs from `DIR/r3jax-programs` without tracing or lowering them; the rest of it is importing "
            "JAX and the server and building the model.", serve_start),
    Section("bench_dtype", "The rollout engine in bf16 and fp32", "python -m experiments.bench_dtype",
            "One fp32 model, two engines of the same shape: `Engine(dtype=jnp.bfloat16)` (a bf16 rollout server) "
            "and fp32, on tiny and the peer config. On CPU the page pool keeps 16-bit floats as their uint16 "
            "bits (`pool_dtype`): XLA:CPU would otherwise convert the whole pool to f32 on every step, which "
            "made a bf16 step 17–27× an fp32 one. `steps`: device calls per round (a call runs up to "
            "`decode_steps` decode steps, or one mixed prefill + decode step); `step_ms`: wall ÷ calls.", bench_dtype),
    Section("bench_engine", "Continuous batching", "python -m experiments.bench_engine",
            "Async multi-turn agents over HTTP on a long-tailed mix of turn lengths, the paged engine's continuous "
            "batching against its `--static` batch-to-completion mode and against one decode step a device call "
            "(`--decode-steps 1`, server `one_step`) (`python -m r3jax serve --model tiny`, 32 requests at once), "
            "and the continuous server again on small_100m (server `small_100m`); in-process latency and "
            "compilation counts. `ms_per_call`: wall ÷ device calls that decode (a call runs "
            "a decode loop of up to 8 steps, or one mixed step); `mean_live_slots`: tokens decoded per such call "
            "(rows × steps). In this run the mixed agents' goal is missed: on tiny they finish with the long "
            "sessions (mixed ÷ long 0.97, goal ≤ 0.5; 1.02 and 1.22 in the two runs before, the second before a "
            "decode call ended where its first caller had its answer, `Engine(return_at_finish=True)`). In this workload they are not the "
            "short ones: their 8 turns, each a request over HTTP on a 2-core machine that also runs the model, "
            "take them 0.67 s alone, against 0.17 s for the long sessions' 3 turns of 96 tokens; in the mix the "
            "mixed agents take 1.8× their time alone, the long sessions 7.4× theirs (goal ≤ 2). Ranked by the "
            "tokens they generate, whatever their kind, the mix's shortest quarter of sessions finishes at 0.84 "
            "of the longest quarter's time (0.58 with one decode step a call, 0.57 on small_100m): a session's "
            "completion follows its turns more than its tokens. With one decode step a call the mixed agents "
            "finish at 0.79 of the long sessions: the long sessions are slower (1.55 s against 1.25) and the "
            "mixed agents no faster (1.22 s either way). On small_100m, whose decode call (about 0.35 s) outweighs "
            "a turn's round trip, the same agents finish at 0.79 of the long sessions, the long sessions take "
            "2.3× their time alone and the mixed agents 1.05×. The goal is out of this workload's reach for a "
            "scheduler fair per token: in the mix the mixed agents generate 152 tokens each on average in 8 "
            "turns, the long sessions 288 in 3, so at equal speed per token and no cost per turn mixed ÷ long "
            "would be 0.53, and every turn adds a prefill and a round trip, 8 times to the one and 3 times to "
            "the other. Each tiny figure is one run of a workload of about a second and moves a lot from run to "
            "run (continuous ÷ static tokens/s on the mix: 1.15 here; 1.04, 1.18, 0.85, 1.17, 0.90, 0.83, 0.92 and "
            "1.14 in earlier runs).", bench_engine),
    Section("bench_paged", "The paged engine (beside the fixed-slot engine it replaced)", "python -m experiments.bench_paged",
            "Tiny model in process, max_seq_len 512, 8 requests at once, seeded request streams: programs and "
            "seconds of `warmup()`; time to first token of short requests (8 + 8 tokens) submitted while 400-token "
            "prompts prefill; a long-tailed mix (about 80% short, some long prompts and long generations): mean "
            "short ÷ mean long completion (goal ≤ 0.5) and long requests in the mix ÷ alone (goal ≤ 2); a fresh "
            "process's warm-up cold and on the persistent compilation cache (goals 30 s and 5 s); one prompt's "
            "samples sharing its prefill. `--quick` runs on a loaded 2-core machine: read the ratios, not the "
            "seconds. In this run the warm-up (cold and restart; 4 programs: an engine of fewer than 12 "
            "requests has no 16-row prefill step), 8 samples of one prompt feeding it about once and a short "
            "request not waiting for a long prefill hold their goals; the mix's short ÷ long is 0.58 (goal ≤ "
            "0.5), and long requests take 3.0× as long in the mix as alone (goal ≤ 2; 2.4 in the run before). A step takes up to 4 "
            "prompt chunks beside the decode rows, more only when that many prompts wait. After a step with "
            "prefill rows the decode rows run a decode loop of 8 tokens while waiting prompts wait that one "
            "call; when every step carried the waiting prompts, decoding ran one token per call and the mix "
            "missed both goals, and cutting that loop to 2 steps while prompts waited made the mix worse too.",
            bench_paged),
    Section("bench_step", "Where a decode step's time goes", "python -m experiments.bench_step",
            "The paged engine's own counters over one warm `generate` of B requests, per device call (`steps`: "
            "calls; a call is a decode loop of up to 8 decode steps, or one mixed step), in ms: host planning, "
            "handing the call to the device, waiting for its outputs, taking them in; and one decode step's "
            "program timed alone (`device_ms`), so a call of the loop takes up to 8 × `device_ms` "
            "(`host_over_device` divides the host's work per call by one step). small_100m twice: its "
            "preset's scanned layers and the same model with `scan_layers=False`. In this run the host's "
            "work per call is 1.1–3.1 ms for tiny against calls of 4.0–11.3 ms, and at most 2.8 ms against "
            "81–612 ms for small_100m, whose scanned layout costs 2.7–5.7× the unrolled one per step "
            "(`device_ms`). B prompts submitted at once are prefilled up to 16 a step, so B = 32 and 64 take "
            "7 and 11 calls: their requests finish a step apart per prefill step, and a decode call is not "
            "cut at the first of them to finish, since their caller waits for all (`Engine(return_at_finish=True)` "
            "ends a call early for a caller that has every answer it waits for; 8 and 14 calls when it cut "
            "at the batch's first request).",
            bench_step),
    Section("bench_weight_sync", "Weight sync", "python -m experiments.bench_weight_sync",
            "Seconds per GB of weights from the trainer to the engine: in process (`push_to_engine`, device to "
            "device; also from a trainer on 4 devices to an engine on 4 others) and to a uvicorn server "
            "(`push_to_server`: an orbax export, then `POST /v1/weights`, which reads it into host arrays and "
            "swaps them in). On CPU device memory is host memory: these price copies and file I/O, not an "
            "interconnect.", bench_weight_sync),
    Section("decode_bytes", "Decode step bytes on a TPU chip", "make decode-bytes",
            "libtpu compiles the engine's decode step (64 requests × 2048-token page tables, every page live) for "
            "v5p:2x2x1 on this CPU host; `must_read`: the parameters a chip holds + its share of the KV pool, "
            "which a decode step must read once; `accessed`: XLA's bytes-accessed estimate of the compiled "
            "program per chip. XLA counts a while loop's body once, a Pallas kernel's own reads not at all and a "
            "conditional as its costliest branch, so the models are compiled with their layers unrolled and only 2 "
            "of them (deepseek_v3: its 3 dense layers and one MoE layer; the preset's shapes otherwise), and once "
            "more with one MoE layer more: `per_layer_ratio` is that layer's accessed ÷ its must-read (with the "
            "kernel its reads of the pool are not counted, so it can fall below 1). `sampler_mib`: the sampler "
            "compiled alone on the step's logits, its costliest branch (the full-vocabulary sort a top-p row "
            "whose nucleus spills past 256 candidates needs); `without_sampler_ratio`: (accessed − sampler) ÷ "
            "must-read, an estimate. `greedy_ratio` / `sampled_ratio`: the 2-layer program traced as a call of "
            "one kind runs it (every row greedy: the sampler's greedy branch; rows sampling at a temperature "
            "without top-k/top-p, as RL rollouts do: the random draw, no filter) ÷ must-read; the engine runs "
            "one program for every mix and takes these branches on device. `auto` is the Pallas ragged paged "
            "attention kernel where it covers the model "
            "(its figure is what runs outside the kernel, which reads the pool in place: the engine stores GQA "
            "keys and values in the kernel's combined layout; MLA's latent cache runs `xla`), `xla` our "
            "gather-over-pages loop (its loop over key blocks counted once: a lower bound). The layout is the "
            "scale plan's first choice (lane-aligned expert shares first, then the fewest resident bytes). "
            "`full_depth_ratio`: the program as compiled with the preset's own layers, all unrolled, on the same "
            "layout (qwen3 48, olmoe 16, mixtral 32; deepseek_v3's 61 layers need 345 GiB a chip on this slice, "
            "more than its 95, so it has only its 4-layer figure), where the head and the sampler weigh what "
            "they do in the deployed model. In this run the kernel path holds its goal (≤ 1.3) for "
            "every model: at full depth qwen3 1.25, olmoe 0.71, mixtral 1.09; deepseek_v3 (MLA: its latent "
            "cache runs `xla`) 1.19 at 4 layers, one layer 1.18. qwen3's 2-layer program (2.49) weighs its "
            "sampler 24 times: the sampler alone is 2,199 MiB (151,936 logits a row). As a greedy call runs it, "
            "qwen3's 2-layer step is 0.92 of its must-read and 1.03 as a sampling call (olmoe 0.63 / 0.65, "
            "mixtral 1.00 / 1.02, deepseek_v3 1.16 / 1.16); one qwen3 layer 1.08. On TPU the `xla` path slices "
            "each layer's pages out of the stacked pool before its key-block loop where a chip holds fewer than "
            "8 interleaved k/v heads (qwen3, mixtral: 4): there XLA lays the loop's pages out anew, and without "
            "the slice it copied the whole stacked pool after every layer's write (28.9 and 11.1 at full depth "
            "at b850fdc); with it a layer copies its own pages (2.54 and 1.79). Where the stack is read in place "
            "(olmoe, 8 a chip; deepseek_v3's latent pool) nothing is sliced: olmoe's `xla` path 0.97 at full "
            "depth.", decode_bytes),
    Section("bench_trace", "Routes, trace, batches", "python -m experiments.bench_trace",
            "Append + finalize of a `RoutedExpertTrace` (Qwen3-30B-A3B route shape) against re-concatenating the "
            "whole prefix every turn; bytes per route row in each wire form; padded against packed batches.",
            bench_trace),
    Section("bench_serve", "Serving", "python -m experiments.bench_serve",
            "Tiny model over HTTP through `RemoteInferenceClient` against the in-process engine on batches of the "
            "same size; `mean_server_batch`: tokens decoded per decode call on the server (rows × steps: a call "
            "runs a decode loop of up to 8 steps, or one mixed step); `vs_serial`: wall time of "
            "c concurrent requests ÷ c × one request's.", bench_serve),
    Section("transfer_cost_route_heavy", "Transfer cost of multi-turn rollouts",
            "python -m experiments.transfer_cost --model route_heavy",
            "The same rollouts over HTTP with `routed_experts_prompt_start = trace.prompt_start` (incremental) "
            "and with start 0 every turn (full re-gather), on a model with Qwen3-30B-A3B's route shape. Ratios "
            "are full ÷ incremental; rows are expected to grow as (T+1)/2.", transfer_cost),
    Section("interop", "Route forms per protocol", "python -m experiments.interop",
            "One 640-row chunk per answer, encoded by the server and decoded by the client in each protocol's "
            "form, per route row and against r3jax's JSON form; then requests/s at concurrency 8 over HTTP.",
            interop),
    Section("bench_scan", "Scanned layers: compile time against depth", "python -m experiments.bench_scan",
            "Compile seconds of the jitted train step with scanned and unrolled layers, all-MoE models of tiny "
            "widths; `scanned_loop` forces a real loop where a short run is lowered unrolled by default.",
            bench_scan),
    Section("bench_attention", "Attention kernels: memory against sequence length, CPU time",
            "python -m experiments.bench_attention",
            "Temporaries of the compiled train step (loss + gradient, batch 1) of a small model at 2k and 8k "
            "tokens with the einsum reference (`xla`) and the blockwise kernel: linear memory gives about 4×, "
            "materialised scores about 16×. Then CPU seconds, blockwise ÷ einsum, same run "
            "([kernels.md](kernels.md)).", bench_attention),
    Section("bench_logits", "Logits in chunks", "python -m experiments.bench_logits",
            "Temporaries of the compiled train step at a 151,936-token vocabulary with the full-vocabulary "
            "logits (`logits_chunk=0`) and in chunks of 512; `*_head_mib`: minus the same step at a 1,024-token "
            "vocabulary (the LM head's and loss's own share).", bench_logits),
    Section("bench_ep", "Expert parallelism", "python -m experiments.bench_ep",
            "Per-device flops and bytes of the compiled train step on 8 simulated devices ÷ the one-device "
            "program's (ideal 0.125); `shard_map` is the expert-parallel layer, `partitioner` the same step with "
            "the MoE layers left to XLA's partitioner.", bench_ep),
    Section("bench_dp", "Data parallelism: engine cores", "python -m experiments.bench_dp",
            "One batch of 64 greedy requests (32-token prompts, 32 new tokens, routes returned; tiny model) "
            "generated by D engine cores (`r3jax.engine.group.EngineGroup`, one simulated CPU device and 64 / D "
            "rows each) against one core. `over_data1`: tokens/s ÷ D = 1's, bounded here by the machine's "
            "cores, not by D; `decode_share` / `mixed_share`: flops of one core's compiled decode-loop and "
            "mixed programs (XLA's cost analysis) ÷ the one-core engine's (ideal 1 / D). The group routes a batch "
            "whole before queuing it (each request counting the load the earlier ones add) and each core admits "
            "its share in one step: in this run 8 cores of 8 rows run 0.99× one core of 64 rows on this 2-core "
            "machine (0.81 when each request was queued as it was routed), 2 cores 1.33×.", bench_dp),
    Section("bench_multiprocess", "Multi-process training", "python -m experiments.bench_multiprocess",
            "Step time of `python -m r3jax train` on one 8-device mesh: one plain process, one process in a "
            "1-process distributed job (gloo) and two processes of 4 devices (gloo over loopback). On one "
            "host this measures coordination overhead, not scaling.", bench_multiprocess),
]


def provenance_line(d: dict, command: str) -> str:
    env = d.get("environment") or {}
    where = ", ".join(x for x in (env.get("backend") and f"{env['backend']}",
                                  env.get("device_count") and f"{env['device_count']} device(s)",
                                  env.get("cpu_count") and f"{env['cpu_count']} CPU cores") if x)
    quick = " (`--quick`)" if d.get("quick") else ""
    commits = d.get("commits") or [d["commit"]]  # a grid filled over several invocations names each
    on = f"commit{'s' if len(commits) > 1 else ''} " + ", ".join(f"`{c}`" for c in commits)
    return f"Measured by `{d.get('command') or command}`{quick} on {on}" + (f" ({where})." if where else ".")


def rerun_line(command: str) -> str:
    return f"Not measured on a released commit yet: run `{command}`."


def stale_line(d: dict, command: str) -> str:
    commits = d.get("commits") or [d.get("commit")]
    return (f"Last measured on commit{'s' if len(commits) > 1 else ''} " + ", ".join(f"`{c}`" for c in commits)
            + f"; the code it measures has changed since, so its figures are not quoted: re-run `{command}`.")


def stale_names() -> set[str]:
    """Results whose measured code changed since their commit, as ``--write`` last found them
    (experiments/results/stale.json; the pages are rendered from files alone, without git history)."""
    d = load(STALE)
    return set(d["stale"]) if d else set()


def find_stale(root: Path = ROOT) -> list[str]:
    """The published results (sections and the scale plan) whose measured code changed since their
    commit (``experiments.freshness``); a result whose commit this clone lacks counts as stale."""
    from experiments import freshness

    out = []
    for name, module in [(s.name, s.module) for s in SECTIONS] + [("scale_plan", "scale_plan")]:
        d = load(name) or {}
        records = [r for r in (d.get("cells", []) if name == "scale_plan" else [d]) if is_clean(r)]
        commits = sorted({c for r in records for c in (r.get("commits") or [r["commit"]])})
        if commits and (not all(freshness.has_commit(c, root) for c in commits)
                        or freshness.stale({"commits": commits}, module, root)):
            out.append(name)
    return out


def section(s: Section) -> tuple[str, bool]:
    """(Markdown of one section, whether it quotes figures)."""
    d = load(s.name)
    head = f"## {s.title}\n\n{s.about}\n\n"
    if d is None or not is_clean(d):
        return head + rerun_line(s.command) + "\n", False
    if s.name in stale_names():
        return head + stale_line(d, s.command) + "\n", False
    return head + provenance_line(d, s.command) + "\n\n" + s.render(d) + "\n", True


def scale_plan() -> tuple[str, bool]:
    head = ("## Memory and compile plan on TPU slices\n\nlibtpu compiles the R3 train step and the engine's "
            "decode step for the devices of real TPU slices on a CPU host (nothing is allocated); the per-chip "
            "peak is XLA's `memory_analysis()`, and a program that does not fit is refused with "
            "RESOURCE_EXHAUSTED as on the slice (`>`: what libtpu said it needed, or, not compiled, the "
            "parameters + optimizer or slot state a chip would hold, where that alone exceeds HBM). Workload: an RL batch of "
            "256 sequences × 8192 tokens; see [scaling.md](scaling.md) for the layouts and "
            "[kernels.md](kernels.md) for the attention and logits kernels. `peak before÷after` divides the "
            "same cell's peak in the plan compiled with einsum attention, full-vocabulary f32 logits and the "
            "expanded MLA cache (`experiments/results/scale_plan_einsum.json`) by this one (`>`: only that "
            "plan was refused, so its figure and the ratio are lower bounds).\n\n")
    d = load("scale_plan")
    cells = (d or {}).get("cells", [])
    clean = [c for c in cells if is_clean(c)]
    if not clean:
        return head + rerun_line("make scale-plan") + "\n", False
    if "scale_plan" in stale_names():
        commits = sorted({c["commit"] for c in clean})
        return head + stale_line({"commits": commits}, "make scale-plan") + "\n", False
    from experiments.scale_plan import BEFORE, COLUMNS, smallest_lines, summary_rows

    prior = load(BEFORE) or {}
    before = [c for c in prior.get("cells", []) if is_clean(c)]
    commits = sorted({c["commit"] for c in clean})
    out = (head + f"Measured by `make scale-plan` on commit{'s' if len(commits) > 1 else ''} "
           + ", ".join(f"`{c}`" for c in commits) + f" ({len(clean)} of {len(cells)} cells).\n\n"
           + table(summary_rows(clean, before), COLUMNS) + "\n")
    if len(clean) < len(cells):
        # "smallest fitting slice" over a subset would name the wrong slice: wait for every cell
        out += (f"\nThe other {len(cells) - len(clean)} cells, and the smallest slice each model fits, are not "
                "measured on a released commit yet: run `make scale-plan`.\n")
    else:
        out += "\nSmallest fitting slice per model and program:\n\n" + "\n".join(
            f"- {line}" for line in smallest_lines(clean)) + "\n"
    return out, True


def measurements() -> str:
    parts, todo = [], []
    for s in SECTIONS:
        md, quoted = section(s)
        parts.append(md)
        if not quoted:
            todo.append(f"- {s.title}: `{s.command}`")
    md, quoted = scale_plan()
    parts.append(md)
    if not quoted:
        todo.append("- Memory and compile plan on TPU slices: `make scale-plan`")
    intro = ("# Measurements\n\n<!-- Generated by `python -m experiments.readme_tables --write` from "
             "experiments/results/*.json; edit that script, not this file. -->\n\n"
             "Every table here comes from the result file of the command named, and is shown only when that "
             "file records a commit and a clean tree, and the code it measures (the experiment and every module "
             "of this repository it imports: `python -m experiments.freshness`) is unchanged since that commit. "
             "Ratios are always from the same run; absolute times depend on the machine and its load (each file "
             "records its environment). `make bench` runs every experiment, `make refresh` only those not current; "
             "`python -m experiments.readme_tables --write` then regenerates this page.\n\n")
    if todo:
        intro += ("To re-run on a released commit (no figures are quoted for these: not measured yet, or the "
                  "code they measure changed since):\n\n") + "\n".join(todo) + "\n\n"
    return intro + "\n".join(parts)


def readme_blocks() -> dict[str, str]:
    """The README's generated blocks: the demo's result and figure, or how to produce them."""
    d = load("demo_summary")
    if d is not None and is_clean(d) and "demo_summary" in stale_names():
        return {"DEMO_RESULTS": stale_line(d, "python -m experiments.train_multiturn")}
    if d is None or not is_clean(d):
        return {"DEMO_RESULTS": "No published demo result yet: `python -m experiments.train_multiturn` runs the "
                                "demo and publishes its table and plot here."}
    return {"DEMO_RESULTS": provenance_line(d, "python -m experiments.train_multiturn") + "\n\n" + demo(d)
            + "\n\n![demo](experiments/results/demo.png)"}


def testing_blocks() -> dict[str, str]:
    """docs/testing.md's generated block: the suite's measured time."""
    return {"SUITE_TIME": suite_time(load("suite_time") or {})}


def fill_markers(text: str, blocks: dict[str, str]) -> str:
    for name, md in blocks.items():
        pattern = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->", re.S)
        text = pattern.sub(lambda _: f"<!-- {name} -->\n{md}\n<!-- /{name} -->", text)
    return text


def write(readme: Path = README, page: Path = MEASUREMENTS) -> None:
    (RESULTS / f"{STALE}.json").write_text(json.dumps({"stale": find_stale()}, indent=2) + "\n")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(measurements())
    readme.write_text(fill_markers(readme.read_text(), readme_blocks()))
    TESTING.write_text(fill_markers(TESTING.read_text(), testing_blocks()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/measurements.md and README.md's blocks")
    args = ap.parse_args()
    if args.write:
        write()
        print(f"wrote {MEASUREMENTS} and the generated blocks of {README}")
    else:
        print(measurements())
        for name, md in {**readme_blocks(), **testing_blocks()}.items():
            print(f"<!-- {name} -->\n{md}\n")


if __name__ == "__main__":
    main()
