"""`check_setup` and `initialize` in one process (8 CPU devices).

The same functions in a real 2-process run: `tests/multihost/test_train_multihost.py`
(the training example checks its setup) and `tests/test_launch.py`.
"""

import sys

import jax
import pytest

import eqxshard
from eqxshard import _compat, _initialize

LAUNCHER_VARS = (
    _initialize.PROCESS_ID_VAR,
    _initialize.NUM_PROCESSES_VAR,
    _initialize.COORDINATOR_VAR,
)


def test_report_says_what_jax_sees():
    report = eqxshard.check_setup()
    assert isinstance(report, eqxshard.SetupReport)
    assert report.process_index == 0
    assert report.process_count == 1
    assert report.local_device_count == report.device_count == 8
    assert report.devices_per_process == (8,)
    assert report.backend == report.platform == "cpu"
    assert report.jax_version == jax.__version__
    text = str(report)
    assert "process 0 of 1" in text
    assert "8 local of 8 devices" in text
    assert "backend 'cpu'" in text


def test_expected_setup_passes():
    report = eqxshard.check_setup(processes=1, devices=8, local_devices=8, platform="cpu")
    assert report.device_count == 8
    assert eqxshard.check_setup(platform="CPU").platform == "cpu"


def test_fell_back_to_cpu():
    with pytest.raises(RuntimeError) as info:
        eqxshard.check_setup(platform="gpu")
    message = str(info.value)
    assert "platform: expected 'gpu', but JAX is using 'cpu'" in message
    assert "fell back to the CPU" in message
    assert "no CUDA/ROCm support installed" in message
    assert "CUDA_VISIBLE_DEVICES" in message
    assert "JAX_PLATFORMS=cpu" in message
    with pytest.raises(RuntimeError, match=r"expected 'tpu'.*no TPU support installed"):
        eqxshard.check_setup(platform="tpu")


def test_process_alone():
    with pytest.raises(RuntimeError) as info:
        eqxshard.check_setup(processes=2)
    message = str(info.value)
    assert "processes: expected 2, but this run has 1" in message
    assert "Every process is running alone" in message
    assert "eqxshard.launch -n 2" in message
    assert "process 0 of 1" in message  # the report is part of the error


def test_device_counts():
    with pytest.raises(RuntimeError, match=r"- devices: expected 16, but found 8\..*JAX_NUM_CPU"):
        eqxshard.check_setup(devices=16)
    with pytest.raises(RuntimeError, match=r"- local devices: expected 4, but found 8"):
        eqxshard.check_setup(local_devices=4)


def test_every_difference_in_one_error():
    with pytest.raises(RuntimeError) as info:
        eqxshard.check_setup(processes=4, devices=32, local_devices=4, platform="gpu")
    lines = [line for line in str(info.value).splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in lines] == [
        "- platform",
        "- processes",
        "- devices",
        "- local devices",
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"processes": 0}, ValueError, r"`processes` must be at least 1, got 0"),
        ({"devices": -8}, ValueError, r"`devices` must be at least 1"),
        ({"local_devices": 2.0}, TypeError, r"`local_devices` must be an int or None, got float"),
        ({"processes": True}, TypeError, r"`processes` must be an int or None, got bool"),
        ({"platform": "xpu"}, ValueError, r"`platform` must be one of 'cpu', 'gpu'.*got 'xpu'"),
        ({"platform": 1}, TypeError, r"`platform` must be a string or None, got int"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        eqxshard.check_setup(**kwargs)


# ----------------------------------------------------------------------------- initialize


class Recorder:
    """Stands in for `jax.distributed.initialize`: records the call, joins nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)


@pytest.fixture
def recorder(monkeypatch):
    record = Recorder()
    monkeypatch.setattr(jax.distributed, "initialize", record)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return record


def test_single_process_joins_nothing(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    hook = sys.excepthook
    assert eqxshard.initialize() == "single process"
    assert recorder.calls == []
    assert sys.excepthook is hook


def test_launcher_variables(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: "SlurmCluster")  # not used
    monkeypatch.setenv(_initialize.COORDINATOR_VAR, "127.0.0.1:4321")
    monkeypatch.setenv(_initialize.NUM_PROCESSES_VAR, "3")
    monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "2")
    hook = sys.excepthook
    assert eqxshard.initialize(heartbeat_timeout_seconds=7) == "eqxshard.launch"
    assert recorder.calls == [
        {
            "coordinator_address": "127.0.0.1:4321",
            "num_processes": 3,
            "process_id": 2,
            "heartbeat_timeout_seconds": 7,
        }
    ]
    # One process in fact (the call above joined nothing): no exit hook.
    assert sys.excepthook is hook


def test_detected_cluster_initializes_without_arguments(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: "SlurmCluster")
    assert eqxshard.initialize() == "SlurmCluster"
    assert eqxshard.initialize(initialization_timeout=30) == "SlurmCluster"
    assert recorder.calls == [{}, {"initialization_timeout": 30}]


def test_coordinator_address_alone_is_left_to_jax(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    monkeypatch.setenv(_initialize.COORDINATOR_VAR, "10.0.0.1:1234")
    assert eqxshard.initialize() == "JAX_COORDINATOR_ADDRESS"
    assert recorder.calls == [{}]


def test_already_initialized(recorder, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "0")
    assert eqxshard.initialize() == "already initialized"
    assert recorder.calls == []


def test_launcher_variables_incomplete(recorder, monkeypatch):
    monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "1")
    with pytest.raises(ValueError, match=r"not EQXSHARD_NUM_PROCESSES, JAX_COORDINATOR_ADDRESS"):
        eqxshard.initialize()
    monkeypatch.setenv(_initialize.NUM_PROCESSES_VAR, "two")
    monkeypatch.setenv(_initialize.COORDINATOR_VAR, "127.0.0.1:4321")
    with pytest.raises(ValueError, match=r"EQXSHARD_NUM_PROCESSES='two' is not an integer"):
        eqxshard.initialize()
    assert recorder.calls == []


SLURM = {
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_NODELIST": "node1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def test_cluster_detection_is_jaxs(monkeypatch):
    for name in [*SLURM, "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"]:
        monkeypatch.delenv(name, raising=False)
    assert _compat.detected_cluster() is None
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert _compat.detected_cluster() == "SlurmCluster"
    for name in SLURM:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1.0;tcp://10.0.0.1:1234")
    assert _compat.detected_cluster() == "OmpiCluster"
