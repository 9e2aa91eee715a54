"""SGLang's tests run in a virtualenv of their own (``make test`` makes it: SGLang's pins
differ from ours); in any other they are not collected (see tests/conftest.py)."""
