"""Test-suite setup: record constructors are type-checked (jaxtyping + beartype) under pytest."""

import os

# Must be set before speculum's record classes are defined, i.e. before any speculum import.
os.environ.setdefault("SPECULUM_TYPECHECK", "1")
# Compiled-round tests (test_compiled.py) compile tiny graphs: inductor's pool of compile
# workers costs more to start than the compilation itself on a small shared machine.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so their parity
# tests against the spec twins run in CI too. Triton reads this when a kernel is decorated, i.e.
# when speculum.kernels is first imported, which is after this file.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis profiles. "ci" (where CI=true, as CI runs .ci/run) is derandomized with no example
# database: every CI run draws the same examples, so a red run is red again and a green one does
# not turn red by chance. "dev" (elsewhere) draws afresh each run, so local runs keep exploring,
# and replays failures kept in .hypothesis/ first. Both print a failure's reproduction blob
# (@reproduce_failure) and have no deadline or too-slow health check, which time the machine.
# HYPOTHESIS_PROFILE=ci or dev (or pytest's --hypothesis-profile) picks one explicitly. "dev"
# names its randomness and database because Hypothesis loads its own derandomized "ci" profile
# on import wherever CI is set, and new settings inherit the loaded profile's.
_untimed = settings(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", _untimed, derandomize=True, database=None)
_examples = DirectoryBasedExampleDatabase(".hypothesis/examples")
settings.register_profile("dev", _untimed, derandomize=False, database=_examples)
_in_ci = os.environ.get("CI", "").lower() in ("true", "1")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if _in_ci else "dev"))
# Tiny test models run fastest single-threaded; thread hand-offs cost more than the math.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Print a GPU test's failure the moment it happens, not only in the summary at the end:
    device runs are cut by their time limits (``tests/gpu/run_lanes.sh``), and a cut run never
    prints its summary."""
    if report.failed and "gpu" in report.keywords:
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)


def tiny_config(**changes):
    """A 2-layer, 32-wide Llama over 64 token ids (no EOS unless asked)."""
    import attrs

    from speculum.runtime.default_model import TINY_CONFIG

    base = attrs.evolve(
        TINY_CONFIG,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_ids=(),
        bos_token_id=None,
    )
    return attrs.evolve(base, **changes)


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random target whose logits are peaked enough that greedy never sees near-ties."""
    from speculum.models.loading import random_model

    return random_model(tiny_config(), seed=0, std=0.3)


class ManualClock:
    """A stand-in for the ``time`` module whose clock moves only when ``sleep`` is called, so
    that timings measured under it are exact: the same on a loaded machine as on an idle one."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        """The seconds slept so far."""
        return self.now

    def sleep(self, seconds: float) -> None:
        """Move the clock on by ``seconds`` without waiting."""
        self.now += seconds


def started(engine, prompt, rounds, **options):
    """A scheduler state after prefilling ``prompt`` alone and ``rounds`` decoding rounds."""
    from speculum.runtime import scheduler

    state, rid = scheduler.add_request(engine, scheduler.new_state(engine), prompt, **options)
    for _ in range(rounds + 1):
        state, _ = scheduler.step(engine, state)
    return state, rid
