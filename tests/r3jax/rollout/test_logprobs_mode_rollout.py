"""The agent loop's sampling settings carry ``logprobs_mode`` into every engine request of every turn."""

import pytest

from r3jax.checks import FieldError
from r3jax.rollout import AgentLoop, ArithmeticEnv, FakeGenerator


def _calls(**sampling):
    gen = FakeGenerator()
    AgentLoop(gen, lambda: ArithmeticEnv(num_turns=2), max_turns=4, max_seq_len=96,
              sampling={"max_tokens": 4, "temperature": 0.7, **sampling}).run(2, 2)
    return gen.calls


def test_every_turns_request_has_the_loops_mode_raw_by_default():
    processed = _calls(logprobs_mode="processed_logprobs")
    assert len(processed) >= 8 and {c.logprobs_mode for c in processed} == {"processed_logprobs"}
    assert {c.temperature for c in processed} == {0.7}
    assert {c.logprobs_mode for c in _calls()} == {"raw_logprobs"}


@pytest.mark.parametrize("bad", ["processed", None])
def test_a_bad_mode_is_refused_naming_the_field(bad):
    with pytest.raises(FieldError) as err:
        _calls(logprobs_mode=bad)
    assert err.value.field == "sampling.logprobs_mode" and err.value.value == bad
