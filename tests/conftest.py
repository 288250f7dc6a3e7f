"""Every test runs with 8 CPU devices; warnings are errors (see pyproject.toml)."""

import os

import jax

# Before JAX initialises its backends: 8 CPU devices on this one machine.
jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
