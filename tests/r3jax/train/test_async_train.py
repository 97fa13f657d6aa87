"""``python -m r3jax train --async``: the trainer reads batch n of a spool that a rollout worker fills
meanwhile (waiting for it), masks tokens older than ``--max-staleness`` versions and counts them, pushes
its weights to a server after every step as version ``steps + 1`` (mode keep), and a resumed run goes
on with the next batch and version. The spool publishes whole batches only, in order, from several workers."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

from models import MoeConfig
from r3jax.batch import collate
from r3jax.serve import create_app
from r3jax.train.spool import Spool

CFG = MoeConfig.tiny()


def _batch(seed: int, version: int):
    """8 single-turn trajectories of 12 tokens (4 prompt + 8 sampled by ``version``), routes captured."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(8):
        n = 12
        loss = np.r_[np.zeros(4), np.ones(8)].astype(np.float32)
        routes = np.stack([rng.permutation(CFG.num_experts)[:CFG.top_k] for _ in range(n * CFG.num_moe_layers)])
        trajs.append(dict(tokens=rng.integers(1, CFG.vocab_size, n), loss_mask=loss,
                          rollout_logprobs=np.where(loss > 0, -1.5, 0.0).astype(np.float32),
                          advantage=float(i % 2) - 0.5, routes=routes.reshape(n, CFG.num_moe_layers, CFG.top_k),
                          captured=np.arange(n) < n - 1, token_versions=np.where(loss > 0, version, -1)))
    return collate(trajs, num_experts=CFG.num_experts, top_k=CFG.top_k, num_layers=CFG.num_moe_layers,
                   batch_multiple=8)


def test_spool_publishes_whole_batches_in_order_from_several_workers(tmp_path):
    spool = Spool(tmp_path / "spool")
    assert len(spool) == 0
    with pytest.raises(TimeoutError, match="batch 0 not published within 0.05 s"):
        spool.wait(0, 0.05)
    numbers = []
    workers = [threading.Thread(target=lambda s=s: numbers.append(spool.put(_batch(s, 1)))) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(numbers) == [0, 1, 2, 3] and len(spool) == 4
    assert not [p for p in spool.dir.iterdir() if p.name.startswith(".tmp-")]  # nothing half-written left
    assert (spool.wait(3, 1.0) / "token_versions.npy").exists()


def test_async_train_waits_for_batches_masks_stale_tokens_and_pushes_versions(tmp_path, serve_helpers):
    from r3jax.train.cli import main

    engine = serve_helpers.FakeEngine()
    app = create_app(engine, load_weights=lambda path, fmt, eng: {"path": path})
    spool, out = Spool(tmp_path / "spool"), tmp_path / "run"
    spool.put(_batch(0, 1))  # sampled by version 1 (the initial weights): fresh at step 1
    with serve_helpers.thread_server(app) as srv:
        def worker():  # the next batches appear while the trainer runs, sampled by version 1 still
            for n in (1, 2):
                spool.put(_batch(n, 1))

        threading.Timer(0.5, worker).start()
        argv = ["--async", "--data", str(spool.dir), "--out", str(out), "--push", srv.url, "--max-staleness", "1",
                "--wait-timeout", "120", "--save-every", "1"]
        main(argv + ["--steps", "3"])
        assert engine.weight_version == 4  # pushed 1 (start), then 2, 3, 4 after each step
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == [1, 2, 3] and [r["weight_version"] for r in recs] == [2, 3, 4]
        assert [r["version_lag_max"] for r in recs] == [0, 1, 2]  # trained at versions 1, 2, 3
        assert [r["stale_masked"] for r in recs] == [0, 0, 64]  # step 3: all 8 x 8 sampled tokens, 2 versions old
        # resumed: the next batch (3) and the next version (5), sampled by version 4
        spool.put(_batch(3, 4))
        main(argv + ["--steps", "4"])
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[-1]["weight_version"] == 5
        assert recs[-1]["version_lag_max"] == 0 and recs[-1]["stale_masked"] == 0
        assert engine.weight_version == 5
        assert httpx.get(srv.url + "/v1/model").json()["weight_version"] == 5
        # a server ahead of the run (weights pushed after its last checkpoint) is an error naming it
        engine.weight_version = 9
        with pytest.raises(SystemExit, match=r"--push .*: the server holds weight version 9, ahead of this run's 5"):
            main(argv + ["--steps", "5"])


@pytest.mark.parametrize("argv,message", [
    (["--data", "d", "--out", "o", "--push", "http://x"], "--push: expected with --async"),
    (["--data", "d", "--out", "o", "--async", "--max-staleness", "-1"], "--max-staleness=-1: expected >= 0"),
    (["--data", "d", "--out", "o", "--async", "--wait-timeout", "0"], "--wait-timeout=0.0: expected > 0"),
])
def test_async_flags_are_checked(argv, message, capsys):
    from r3jax.train.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
