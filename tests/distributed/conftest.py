"""The distributed tests' launcher setting: a spawn whose rank crashes in torch's C++ (SIGSEGV or SIGABRT inside a
gloo collective, seen rarely on 2 loaded CPU cores; ``../shared/PLATFORM-NOTES.md``) starts its ranks once more,
with a warning that shows the crash. A rank that raises, a wrong result or a timeout still fails at once."""

import pytest

from tessera.runtime import launch


@pytest.fixture(autouse=True, scope="session")
def _one_retry_after_a_crash():
    saved, launch.CRASH_RETRIES = launch.CRASH_RETRIES, 1
    yield
    launch.CRASH_RETRIES = saved
