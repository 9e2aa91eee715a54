"""SGLang's tests run in a virtualenv of their own (``make test`` makes it: SGLang's pins
differ from ours); in any other they are not collected (see tests/conftest.py)."""

from tests.server_loads import traced

__all__ = ["traced"]  # the fixture, for this suite's tests
