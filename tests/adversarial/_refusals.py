"""The assertion the adversarial tests share: a call refused with a ConfigError naming given words."""

import pytest

from qerl_kit.config_types import ConfigError


def refused(fn, *words):
    """``fn()`` raises a ConfigError whose message holds every one of ``words``; returns the message."""
    with pytest.raises(ConfigError) as err:
        fn()
    msg = str(err.value)
    for word in words:
        assert word in msg, (word, msg)
    return msg
