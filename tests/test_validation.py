"""validation.check_int: the one integer validator (types, bounds, one wording, plain int out)."""

import numpy as np
import pytest

from gptoss_lite.config import ModelConfig
from gptoss_lite.validation import check_int


@pytest.mark.parametrize("value", [0, 7, np.int64(7), np.int32(-3), np.uint8(5)])
def test_integral_values_come_back_as_plain_int(value):
    """Any numbers.Integral (numpy included) is accepted and returned as a built-in int of equal value."""
    out = check_int("n", value)
    assert type(out) is int and out == int(value)


@pytest.mark.parametrize(
    "value, kind", [(True, "bool"), (np.bool_(True), "bool"), (2.0, "float"), ("3", "str"), (None, "NoneType")]
)
def test_non_integers_are_type_errors(value, kind):
    """Booleans, floats (even whole ones), strings and None are TypeErrors naming the argument and type."""
    with pytest.raises(TypeError, match=rf"^n={value!r}: must be an int \(not {kind}\)$"):
        check_int("n", value)


def test_bounds_are_inclusive_and_named_in_the_message():
    """minimum and maximum are inclusive; a value outside raises ValueError stating the allowed range."""
    assert check_int("n", 1, 1, 3) == 1 and check_int("n", 3, 1, 3) == 3
    with pytest.raises(ValueError, match=r"^n=0: must be in \[1, 3\]$"):
        check_int("n", 0, 1, 3)
    with pytest.raises(ValueError, match=r"^n=4: must be in \[1, 3\]$"):
        check_int("n", np.int64(4), minimum=1, maximum=3)
    with pytest.raises(ValueError, match=r"^n=0: must be >= 1$"):
        check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match=r"^n=4: must be <= 3$"):
        check_int("n", 4, maximum=3)


def test_model_config_stores_plain_ints():
    """A numpy integer given to ModelConfig is stored as a plain int, so the config stays JSON-serialisable."""
    cfg = ModelConfig(d_model=np.int64(768))
    assert type(cfg.d_model) is int
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    cfg.to_json()
