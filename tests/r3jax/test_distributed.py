"""Which jax.distributed.initialize arguments the flags and the environment give (no job is joined:
the two-process run itself is tests/r3jax/train/test_multiprocess.py)."""

import pytest

from r3jax.distributed import resolve


def test_single_process_unless_told_otherwise():
    assert resolve(environ={}) is None
    assert resolve(num_processes=1, environ={}) is None
    # with a coordinator, one process still joins a (1-process) job: gloo collectives like several
    assert resolve(num_processes=1, coordinator="127.0.0.1:1234", environ={}) == {
        "coordinator_address": "127.0.0.1:1234", "num_processes": 1, "process_id": 0}


def test_flags_win_over_the_environment_which_fills_the_gaps():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert resolve(environ=env) == {"coordinator_address": "10.0.0.1:8476", "num_processes": 4, "process_id": 3}
    assert resolve(num_processes=2, process_id=1, environ=env) == {
        "coordinator_address": "10.0.0.1:8476", "num_processes": 2, "process_id": 1}


def test_auto_leaves_the_rest_to_cluster_detection():
    assert resolve(num_processes="auto", environ={}) == {}
    assert resolve(environ={"JAX_NUM_PROCESSES": "auto", "JAX_COORDINATOR_ADDRESS": "h:1"}) == {
        "coordinator_address": "h:1"}


@pytest.mark.parametrize("kwargs,env,message", [
    ({"num_processes": 2}, {}, r"--num-processes=2 needs --coordinator \(or JAX_COORDINATOR_ADDRESS\) and "
                               r"--process-id \(or JAX_PROCESS_ID\)"),
    ({"num_processes": 2, "coordinator": "h:1"}, {}, r"needs --process-id \(or JAX_PROCESS_ID\)$"),
    ({"num_processes": 2, "process_id": 2, "coordinator": "h:1"}, {}, r"--process-id=2: expected a process id in \[0, 2\)"),
    ({"process_id": 0, "coordinator": "h:1"}, {"JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES='two': expected an int"),
    ({"num_processes": 0}, {}, r"--num-processes=0: expected an int >= 1, or 'auto'"),
    ({"num_processes": 2, "process_id": 0, "coordinator": "localhost"}, {}, r"--coordinator='localhost': expected HOST:PORT"),
    ({"num_processes": 2, "process_id": -1, "coordinator": "h:1"}, {}, r"--process-id=-1: expected an int >= 0"),
])
def test_rejections_name_the_flag_or_variable(kwargs, env, message):
    with pytest.raises(ValueError, match=message):
        resolve(**kwargs, environ=env)
