import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    # A different seed per test, fixed across runs (so failures reproduce).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def workspace():
    return np.zeros(16 << 20, dtype=np.uint8)
