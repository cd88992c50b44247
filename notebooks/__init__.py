"""Makes notebooks/ a package for pytest only, so that its conftest.py is imported as
``notebooks.conftest`` and does not collide with ``tests/conftest.py``. The chapters do not
import it."""
