"""pytest's setup for the chapters' nbval runs (`make test`, `make test-notebooks`).

A chapter's kernel is started again, up to twice more, if it dies before it answers its first
message: nbval then has no kernel at all, and reports every cell of the chapter as an error.
This happened once, in one fresh-clone CI run, to chapter 10, whose cells all pass when run
again. The likely cause is a known race in starting kernels: jupyter_client picks a kernel's
TCP ports by binding port 0 and closing the socket. Another process can take that port before
the new kernel binds it (under xdist, chapter 22's Dask cluster is opening its own), and the
kernel then exits ("Address already in use": jupyter/jupyter_client#154, jupyter/nbconvert#1066).
Only the start is retried, with fresh ports; a cell that fails is never run again.
"""

import nbval.kernel

_start_new_kernel = nbval.kernel.start_new_kernel
_ATTEMPTS = 3


def _start_new_kernel_again_if_it_dies(*args, **kwargs):
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return _start_new_kernel(*args, **kwargs)
        except RuntimeError as error:  # nbval has shut the dead kernel down before re-raising
            if "Kernel died before replying to kernel_info" not in str(error) or attempt == _ATTEMPTS:
                raise
            print(f"nbval: the kernel died while starting (attempt {attempt} of {_ATTEMPTS}); "
                  "starting it again")


nbval.kernel.start_new_kernel = _start_new_kernel_again_if_it_dies


def pytest_collection_modifyitems(config, items):
    """Skip, with the reason in pytest's summary, each chapter cell that needs a package this
    platform cannot install (``notebooks/_platform.py``: Triton off Linux). None on Linux."""
    import pytest

    from notebooks import _platform

    for item in items:
        cell = getattr(item, "cell", None)  # nbval's items carry their notebook cell
        if cell is None:
            continue
        for tag in _platform.missing(cell.get("metadata", {}).get("tags", [])):
            item.add_marker(pytest.mark.skip(reason=_platform.reason(tag)))
