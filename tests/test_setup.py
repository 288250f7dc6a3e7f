"""`check_setup` and `initialize` in one process (8 CPU devices).

The same functions in a real 2-process run: `tests/multihost/test_train_multihost.py`
(the training example checks its setup) and `tests/test_launch.py`.
"""

import socket
import sys
import zlib

import jax
import pytest

import eqxshard
from eqxshard import _compat
from eqxshard._processes import (
    addresses as _addresses,
    clusters as _clusters,
    initialize as _initialize,
)

LAUNCHER_VARS = (
    _initialize.PROCESS_ID_VAR,
    _initialize.NUM_PROCESSES_VAR,
    _initialize.COORDINATOR_VAR,
)
# Every variable of a launcher that `initialize` reads, cleared before each test.
CLUSTER_VARS = (
    *("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    *("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE"),
    *("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
    *("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    *("JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS"),
)


def test_report_says_what_jax_sees():
    report = eqxshard.check_setup()
    assert isinstance(report, eqxshard.report.SetupReport)
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
    """Stands in for `jax.distributed.initialize`: records the call, joins nothing.

    `jax.process_count()` then says `joins` (1 unless a test sets it)."""

    def __init__(self):
        self.calls = []
        self.joins = 1

    def __call__(self, **kwargs):
        self.calls.append(kwargs)


@pytest.fixture
def recorder(monkeypatch):
    record = Recorder()
    monkeypatch.setattr(jax.distributed, "initialize", record)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax, "process_count", lambda: record.joins)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    # No watcher of stderr (it would take over this test process's stderr).
    monkeypatch.setenv("EQXSHARD_WATCH", "0")
    for name in [*LAUNCHER_VARS, *CLUSTER_VARS]:
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
    recorder.joins = 3
    assert eqxshard.initialize(heartbeat_timeout_seconds=7) == "eqxshard.launch"
    assert recorder.calls == [
        {
            "coordinator_address": "127.0.0.1:4321",
            "num_processes": 3,
            "process_id": 2,
            "heartbeat_timeout_seconds": 7,
        }
    ]
    # Several processes: the exit hook is set.
    assert sys.excepthook is not hook


def test_launcher_variables_one_process_sets_no_exit_hook(recorder, monkeypatch):
    monkeypatch.setenv(_initialize.COORDINATOR_VAR, "127.0.0.1:4321")
    monkeypatch.setenv(_initialize.NUM_PROCESSES_VAR, "1")
    monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "0")
    hook = sys.excepthook
    assert eqxshard.initialize() == "eqxshard.launch"
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


# ------------------------------------------------- launchers JAX does not detect by itself

# What Open MPI 5's `mpirun -n 2` sets for its second process (measured, 5.0.11): no
# OMPI_MCA_orte_hnp_uri, so JAX's own detection finds nothing.
OMPI5 = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "PMIX_NAMESPACE": "prterun-vm-5765@1",
}
# What MPICH's `mpiexec -n 2` (hydra) sets for its first process (measured, 5.0).
HYDRA = {"PMI_SIZE": "2", "PMI_RANK": "0", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "0"}


def setenvs(monkeypatch, variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def hand_port(key):
    # JAX's range for Slurm and Open MPI 4: the top 4096 ports.
    return 65536 - 4096 + zlib.crc32(key.encode()) % 4096


def test_open_mpi_5_on_one_node(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(monkeypatch, OMPI5)
    recorder.joins = 2
    hook = sys.excepthook
    assert eqxshard.initialize(initialization_timeout=9) == "Open MPI"
    port = hand_port("prterun-vm-5765@1")
    assert 61440 <= port <= 65535
    assert recorder.calls == [
        {
            "num_processes": 2,
            "process_id": 1,
            "local_device_ids": [1],
            "coordinator_address": f"127.0.0.1:{port}",
            "initialization_timeout": 9,
        }
    ]
    assert sys.excepthook is not hook


def test_open_mpi_5_port_and_address_given(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(monkeypatch, OMPI5)
    recorder.joins = 2
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "12345")
    eqxshard.initialize()
    assert recorder.calls[-1]["coordinator_address"] == "127.0.0.1:12345"
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "node7:2222")
    eqxshard.initialize()
    assert recorder.calls[-1]["coordinator_address"] == "node7:2222"
    # JAX_LOCAL_DEVICE_IDS decides the devices: JAX reads it when none are given.
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")
    eqxshard.initialize()
    assert "local_device_ids" not in recorder.calls[-1]
    assert "cluster_detection_method" not in recorder.calls[-1]


def test_open_mpi_one_process_per_node_sees_every_device(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(
        monkeypatch, {**OMPI5, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "JAX_COORDINATOR_ADDRESS": "n0:1"}
    )
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    recorder.joins = 2
    eqxshard.initialize()
    # Nothing left for JAX to fill in from other variables (e.g. an enclosing Slurm job's).
    assert recorder.calls == [
        {
            "num_processes": 2,
            "process_id": 1,
            "coordinator_address": "n0:1",
            "cluster_detection_method": "deactivate",
        }
    ]


def test_mpi_on_several_nodes(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(monkeypatch, {**OMPI5, "OMPI_COMM_WORLD_SIZE": "4"})  # 2 of 4 on this node
    monkeypatch.setattr(_clusters, "has_mpi4py", lambda: False)
    with pytest.raises(ValueError, match=r"(?s)4 processes started by Open MPI's launcher on "
                       r"several nodes.*OMPI_COMM_WORLD_SIZE=4.*JAX_COORDINATOR_ADDRESS=HOST:PORT"
                       r".*mpirun -x JAX_COORDINATOR_ADDRESS=node0:12345.*mpi4py"):  # fmt: skip
        eqxshard.initialize()
    assert recorder.calls == []
    monkeypatch.setattr(_clusters, "has_mpi4py", lambda: True)
    recorder.joins = 4
    assert eqxshard.initialize() == "Open MPI (mpi4py)"
    assert recorder.calls == [{"cluster_detection_method": "mpi4py"}]


def test_open_mpi_4_is_left_to_jax(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: "OmpiCluster")
    setenvs(monkeypatch, {**OMPI5, "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1234"})
    recorder.joins = 2
    assert eqxshard.initialize() == "OmpiCluster"
    # Named: JAX would otherwise take Slurm's variables first, where both are set.
    assert recorder.calls == [{"cluster_detection_method": "ompi"}]


def test_mpich_on_one_node(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(monkeypatch, HYDRA)
    monkeypatch.setattr(_clusters, "hydra_proxy_pid", lambda: 4242)
    recorder.joins = 2
    assert eqxshard.initialize() == "MPICH"
    port = hand_port(f"{socket.gethostname()}:4242")
    assert recorder.calls == [
        {
            "num_processes": 2,
            "process_id": 0,
            "local_device_ids": [0],
            "coordinator_address": f"127.0.0.1:{port}",
        }
    ]
    # Without a hydra proxy to name the job: the port must be given.
    monkeypatch.setattr(_clusters, "hydra_proxy_pid", lambda: None)
    with pytest.raises(ValueError, match=r"started by MPICH's launcher \(PMI_SIZE=2, PMI_RANK=0.*"
                       r"no id of the job.*Set JAX_COORDINATOR_PORT"):  # fmt: skip
        eqxshard.initialize()


def test_no_hydra_proxy_here():
    assert _clusters.hydra_proxy_pid() is None


def test_mpi_variables_come_before_an_enclosing_slurm_jobs(recorder, monkeypatch):
    # `mpiexec` inside an allocation: SLURM_* describe the allocation, not these processes.
    monkeypatch.setattr(_compat, "detected_cluster", lambda: "SlurmCluster")
    setenvs(monkeypatch, {**SLURM, "SLURM_NTASKS": "1", **HYDRA})
    monkeypatch.setattr(_clusters, "hydra_proxy_pid", lambda: 4242)
    recorder.joins = 2
    assert eqxshard.initialize() == "MPICH"
    # `srun --mpi=pmi2`: the same processes, and Slurm's variables name the first node.
    setenvs(monkeypatch, {**SLURM, "SLURM_NTASKS": "2", "SLURM_PROCID": "0"})
    assert eqxshard.initialize() == "SlurmCluster"
    assert recorder.calls[-1] == {}


def test_run_of_another_size_raises(recorder, monkeypatch):
    monkeypatch.setattr(_compat, "detected_cluster", lambda: None)
    setenvs(monkeypatch, OMPI5)
    recorder.joins = 1  # what `jax.distributed.initialize()` alone did under Open MPI 5
    with pytest.raises(RuntimeError, match=r"joined a run of 1 processes, but the environment "
                       r"says 2 \(Open MPI; variables seen: OMPI_COMM_WORLD_SIZE=2, "
                       r"OMPI_COMM_WORLD_RANK=1, .*unset them"):  # fmt: skip
        eqxshard.initialize()
    for name in OMPI5:
        monkeypatch.delenv(name)
    monkeypatch.setattr(_compat, "detected_cluster", lambda: "SlurmCluster")
    setenvs(monkeypatch, {**SLURM, "SLURM_NTASKS": "4"})
    recorder.joins = 2
    with pytest.raises(RuntimeError, match=r"run of 2 processes, but the environment says 4 "
                       r"\(SlurmCluster; variables seen: .*SLURM_NTASKS=4"):  # fmt: skip
        eqxshard.initialize()


def test_mpi_variables_not_integers(recorder, monkeypatch):
    setenvs(monkeypatch, {**OMPI5, "OMPI_COMM_WORLD_RANK": "one"})
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_RANK='one' is not an integer"):
        eqxshard.initialize()
    assert recorder.calls == []


def test_a_taken_coordinator_port_is_said_before_jax_is_called(recorder, monkeypatch):
    """JAX's own answer to a taken port is a bare "Failed to start RPC server", or a
    SIGSEGV; process 0 says which port is taken instead, before calling JAX."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        monkeypatch.setenv(_initialize.COORDINATOR_VAR, address)
        monkeypatch.setenv(_initialize.NUM_PROCESSES_VAR, "2")
        monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "0")
        match = f"could not start the coordinator of the run \\(process 0\\) at {address}: its port"
        with pytest.raises(RuntimeError, match=match):
            eqxshard.initialize()
        assert recorder.calls == []
        # Another process of the run only connects to it: no check there.
        monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "1")
        recorder.joins = 2
        assert eqxshard.initialize() == "eqxshard.launch"
    assert len(recorder.calls) == 1


def test_jax_failing_to_start_the_coordinator_is_the_same_error(recorder, monkeypatch):
    def fail(**kwargs):
        raise RuntimeError("UNKNOWN: Failed to start RPC server")

    monkeypatch.setattr(jax.distributed, "initialize", fail)
    monkeypatch.setattr(_addresses, "port_taken", lambda address: False)  # taken just after
    monkeypatch.setenv(_initialize.COORDINATOR_VAR, "127.0.0.1:4321")
    monkeypatch.setenv(_initialize.NUM_PROCESSES_VAR, "2")
    monkeypatch.setenv(_initialize.PROCESS_ID_VAR, "0")
    with pytest.raises(RuntimeError, match=r"at 127.0.0.1:4321: its port is taken") as info:
        eqxshard.initialize()
    assert "Failed to start RPC server" in str(info.value.__cause__)


def test_port_taken():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        other.listen()
        assert _addresses.port_taken(f"127.0.0.1:{port}")
        assert _addresses.port_taken(f"somehost:{port}")
    assert not _addresses.port_taken(f"127.0.0.1:{port}")
    assert not _addresses.port_taken("no-port")
