"""Every test runs with 8 CPU devices; warnings are errors (see pyproject.toml)."""

import os

import jax

# Before JAX initialises its backends: 8 CPU devices on this one machine.
jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


def pytest_collection_modifyitems(config, items):
    """The files whose every test is heavy (subprocesses: notebooks, examples, launchers,
    simulated nodes) run first, then those with some heavy tests (docs pages, searches), then
    the rest; each file kept whole, in its order (its module fixtures set up once). Under
    `-n 2` the long tests start early and the many short ones fill in at the end, instead of
    one worker waiting while the other runs a minute-long page."""
    marks: dict[object, set[bool]] = {}
    for item in items:
        module = getattr(item, "module", None)
        marks.setdefault(module, set()).add(item.get_closest_marker("heavy") is not None)
    group = {
        module: 0 if kinds == {True} else 1 if True in kinds else 2
        for module, kinds in marks.items()
    }
    items.sort(key=lambda item: group[getattr(item, "module", None)])
