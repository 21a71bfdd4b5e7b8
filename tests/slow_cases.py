"""Which cases of a test grid run by default: one a code path keeps the default run near its 20 minutes;
the cases that repeat a path at another shape, dtype or head count run with the slow tests."""
import pytest


def slow_at(values, slow) -> list:
    """`values` as parametrize entries (a tuple: one case's arguments), those at the indices in `slow`
    marked slow."""
    def param(v, marks):
        return pytest.param(*v, marks=marks) if isinstance(v, tuple) else pytest.param(v, marks=marks)

    return [param(v, pytest.mark.slow) if i in slow else v for i, v in enumerate(values)]
