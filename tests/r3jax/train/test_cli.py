"""``python -m r3jax train`` flags: what is refused before any device work (the job itself runs in
test_multiprocess.py)."""

import pytest

from r3jax.train.cli import main, parse_args


@pytest.mark.parametrize("argv,message", [
    ([], "--data and --out are required (or --write-example-data DIR)"),
    (["--data", "d", "--out", "o", "--mesh", "2,2"], "--mesh='2,2': expected three comma-separated ints DATA,FSDP,EXPERT"),
    (["--data", "d", "--out", "o", "--mesh", "a,b,c"], "--mesh='a,b,c': expected three comma-separated ints"),
    (["--data", "d", "--out", "o", "--steps", "0"], "--steps=0: expected >= 1"),
])
def test_bad_flags_exit_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_an_incomplete_job_description_exits_before_joining(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit, match=r"r3jax train: error: --num-processes=2 needs --coordinator"):
        main(["--data", "d", "--out", "o", "--num-processes", "2", "--process-id", "0"])
    args = parse_args(["--data", "d", "--out", "o"])
    assert args.mesh_shape == (-1, 1, 1) and args.replay == "rollout" and args.batch_size is None
