"""A failure's cause in one line: the root of a wrapper (Ray keeps it as `cause`), no colour codes."""

from miles.config import ConfigError
from miles.runtime.trace import error_record, error_summary, root_cause
from miles.traceview.report import _error_line


class Wrapper(Exception):
    """What Ray's RayTaskError looks like: its message is the remote traceback, the original is `cause`."""

    def __init__(self, cause):
        super().__init__("\x1b[36mray::Executor.generate()\x1b[39m (pid=1)\n  File ...\nlong traceback")
        self.cause = cause


def test_the_root_of_a_wrapper_in_one_line_without_colour():
    inner = ValueError("reward.py:reward returned nan\nsecond line")
    wrapped = Wrapper(inner)
    assert root_cause(wrapped) is inner
    assert error_summary(wrapped) == "ValueError: reward.py:reward returned nan"
    record = error_record(wrapped)
    assert record["summary"] == "ValueError: reward.py:reward returned nan"
    assert "\x1b[" not in record["message"] and "\x1b[" not in record["traceback"]
    assert _error_line(record) == record["summary"]                 # what `miles trace show` prints first


def test_a_config_error_is_its_problems_on_one_line():
    assert error_summary(ConfigError(["--a is bad", "--b is bad"])) == "ConfigError: --a is bad; --b is bad"
    assert error_summary(RuntimeError()) == "RuntimeError"
