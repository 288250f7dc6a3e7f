"""`filter_save`, `filter_restore`, `latest_step`: sharded checkpoints through orbax.

Round trips are compared bit for bit; restores go onto other meshes (Auto, Explicit,
mixed), other device counts and every form of `target`/`spec` that `filter_shard` takes.
The 2-process round trips are in `tests/multihost/test_checkpoint_multihost.py`.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import (
    MESH_KINDS,
    assert_placed,
    assert_tree_values,
    make_mesh,
    make_model,
    named,
    tree_data,
    without_jax_settings,
)
from jax.sharding import PartitionSpec as P, SingleDeviceSharding

import eqxshard
from eqxshard import filter_restore, filter_save, latest_step
from eqxshard._checkpoint import save as _checkpoint, store as _store


def placed_model(kind: str = "explicit", seed: int = 0):
    """`make_model` split over "data" of a (4, 2) mesh (every leaf's dim 0 is 4)."""
    return eqxshard.filter_shard(make_model(seed), make_mesh(kind), P("data"))


def abstract_model():
    return eqx.filter_eval_shape(make_model, 1)


def assert_statics_from(out, like) -> None:
    """`out` has `like`'s structure and its very non-array leaves (`like` may be abstract)."""
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    like_leaves, like_def = jax.tree_util.tree_flatten(like)
    assert out_def == like_def
    for a, b in zip(out_leaves, like_leaves, strict=True):
        if isinstance(b, jax.ShapeDtypeStruct) or eqx.is_array(b):
            assert isinstance(a, jax.Array) and (a.shape, a.dtype) == (b.shape, b.dtype)
        else:
            assert a is b, (a, b)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_round_trip_keeps_values_shardings_and_statics(tmp_path: Path, kind: str) -> None:
    model = placed_model(kind)
    handle = filter_save(tmp_path, 3, model)
    assert handle.done() and handle.step == 3
    out = filter_restore(tmp_path, model)  # no target: `like`'s own shardings
    assert_tree_values(out, model)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(model), strict=True):
        if eqx.is_array(b):
            assert_placed(a, b.sharding, b)
    assert jnp.issubdtype(out.key.dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_restore_onto_another_mesh_from_an_abstract_like(tmp_path: Path, kind: str) -> None:
    model = placed_model("explicit")
    filter_save(tmp_path, 0, model)
    like = abstract_model()
    mesh = make_mesh(kind, shape=(2, 4), names=("data", "model"))
    out = filter_restore(tmp_path, like, mesh, P("model"))
    assert_statics_from(out, like)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(model), strict=True):
        if eqx.is_array(b):
            assert_placed(a, named(mesh, "model"), b)


def test_restore_onto_fewer_devices_with_a_rule(tmp_path: Path) -> None:
    filter_save(tmp_path, 0, placed_model())
    mesh = make_mesh("explicit", shape=(2,), names=("data",))
    out = filter_restore(tmp_path, abstract_model(), mesh, eqxshard.fsdp("data", min_size=0))
    expected = eqxshard.filter_shardings(abstract_model(), mesh, eqxshard.fsdp("data", min_size=0))
    arrays = [x for x in jax.tree.leaves(out) if eqx.is_array(x)]
    for a, s in zip(arrays, jax.tree.leaves(expected), strict=True):
        assert_placed(a, s)
    assert_tree_values(eqxshard.filter_get(out), eqxshard.filter_get(placed_model()))


def test_restore_plain_tree_with_numpy_bfloat16_and_key_leaves(tmp_path: Path) -> None:
    tree = tree_data()
    filter_save(tmp_path, 0, tree)
    mesh = make_mesh("auto")
    out = filter_restore(tmp_path, tree, mesh, P(("data", "model")))
    assert_tree_values(out, tree)
    assert out["c"][0].dtype == jnp.bfloat16
    assert_placed(out["b"][0], named(mesh, ("data", "model")))


def test_target_forms(tmp_path: Path) -> None:
    model = placed_model()
    filter_save(tmp_path, 0, model)
    like = abstract_model()
    device = jax.devices()[5]
    mesh = make_mesh("explicit", shape=(4,), names=("data",))
    # a Device, a Sharding
    out = filter_restore(tmp_path, like, device)
    assert_placed(out.scale, SingleDeviceSharding(device), model.scale)
    out = filter_restore(tmp_path, like, named(mesh))
    assert_placed(out.linear.weight, named(mesh), model.linear.weight)
    # a prefix tree of targets, `None` = keep `like`'s own sharding (here a placed model)
    target = jax.tree.map(lambda _: None, model)
    target = eqx.tree_at(
        lambda m: m.linear, target, named(mesh, "data"), is_leaf=lambda x: x is None
    )
    out = filter_restore(tmp_path, model, target)
    assert_placed(out.linear.weight, named(mesh, "data"), model.linear.weight)
    assert_placed(out.scale, model.scale.sharding, model.scale)
    # a PartitionSpec against the mesh set by `jax.set_mesh`, and a callable spec
    with jax.set_mesh(mesh):
        out = filter_restore(tmp_path, like, P("data"))
    assert_placed(out.steps, named(mesh, "data"), model.steps)
    out = filter_restore(tmp_path, like, mesh, lambda path, leaf: P() if leaf.ndim else None)
    assert_placed(out.key, named(mesh), model.key)


def test_like_with_shape_dtype_struct_shardings(tmp_path: Path) -> None:
    model = placed_model()
    filter_save(tmp_path, 0, model)
    mesh = make_mesh("explicit", shape=(8,), names=("x",))
    mesh4 = make_mesh("explicit", shape=(4,), names=("x",), devices=jax.devices()[4:])
    like = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named(mesh, "x"))
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        abstract_model(),
    )
    with pytest.raises(ValueError, match=r"cannot split(.|\n)*\n  scale "):
        filter_restore(tmp_path, like)  # the checks of `filter_shard` run on them too
    like = eqx.tree_at(lambda m: m.linear.weight, like, model.linear.weight)
    like = eqx.tree_at(
        lambda m: (m.scale, m.steps, m.key, m.linear.bias),
        like,
        replace_fn=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named(mesh4, "x")),
    )
    out = filter_restore(tmp_path, like)
    assert_placed(out.steps, named(mesh4, "x"), model.steps)
    assert_placed(out.linear.weight, model.linear.weight.sharding, model.linear.weight)


def test_steps_latest_and_async(tmp_path: Path) -> None:
    assert latest_step(tmp_path / "missing") is None
    assert latest_step(tmp_path) is None
    first, second = placed_model(seed=0), placed_model(seed=1)
    filter_save(tmp_path, 10, first)
    pending = filter_save(tmp_path, 20, second, wait=False)
    pending.wait()
    assert pending.done() and latest_step(tmp_path) == 20
    pending.wait()  # waiting twice is fine
    # a lower step than the latest is saved too (orbax alone would skip it)
    filter_save(tmp_path, 5, first)
    assert latest_step(tmp_path) == 20
    assert_tree_values(filter_restore(tmp_path, first), second)
    assert_tree_values(filter_restore(tmp_path, first, step=10), first)
    assert_tree_values(filter_restore(tmp_path, first, step=5), first)


def test_a_save_waits_for_the_running_one(tmp_path: Path) -> None:
    models = [placed_model(seed=s) for s in range(3)]
    handles = [filter_save(tmp_path, s, m, wait=False) for s, m in enumerate(models)]
    for h in handles[:-1]:  # each was waited for by the save after it
        assert h.done()
    handles[-1].wait()
    for s, m in enumerate(models):
        assert_tree_values(filter_restore(tmp_path, m, step=s), m)


def test_an_unfinished_save_is_not_a_step(tmp_path: Path) -> None:
    """What a save killed halfway leaves (orbax's temporary directory) is ignored by
    `latest_step` and `filter_restore`, and the step can be saved again."""
    model = placed_model()
    filter_save(tmp_path, 1, model)
    unfinished = tmp_path / "2.orbax-checkpoint-tmp"
    (unfinished / "default").mkdir(parents=True)
    (unfinished / "default" / "partial").write_bytes(b"half a shard")
    assert latest_step(tmp_path) == 1
    assert_tree_values(filter_restore(tmp_path, model), model)
    filter_save(tmp_path, 2, model)
    assert latest_step(tmp_path) == 2 and not unfinished.exists()
    assert_tree_values(filter_restore(tmp_path, model, step=2), model)


def test_max_to_keep(tmp_path: Path) -> None:
    model = placed_model()
    for step in range(4):
        filter_save(tmp_path, step, model, max_to_keep=2)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]


def test_root_array_and_string_directory(tmp_path: Path) -> None:
    x = jnp.arange(6.0)
    filter_save(str(tmp_path), 0, x)
    out = filter_restore(str(tmp_path), jax.ShapeDtypeStruct((6,), jnp.float32), jax.devices()[1])
    assert_placed(out, SingleDeviceSharding(jax.devices()[1]), x)


# ----------------------------------------------------------------------------- errors


def test_mismatch_lists_every_leaf(tmp_path: Path) -> None:
    filter_save(tmp_path, 0, {"a": jnp.zeros((4, 2)), "b": jnp.zeros(3), "c": jnp.zeros(2)})
    like = {
        "a": jax.ShapeDtypeStruct((2, 4), jnp.float32),  # shape differs
        "b": jax.ShapeDtypeStruct((3,), jnp.int32),  # dtype differs
        "d": jax.ShapeDtypeStruct((1,), jnp.float32),  # not in the checkpoint
    }  # and "c" is not in `like`
    with pytest.raises(ValueError, match="does not match `like`") as info:
        filter_restore(tmp_path, like, jax.devices()[0])
    message = str(info.value)
    assert "a  in `like` as (2, 4) float32  in the checkpoint as (4, 2) float32" in message
    assert "b  in `like` as (3,) int32" in message and "(3,) float32" in message
    assert "d  in `like` as (1,) float32    not in the checkpoint" in message
    assert "c  not in `like`" in message
    assert "Build `like` as the saved tree was built" in message


def test_a_key_restored_into_a_non_key_is_a_mismatch(tmp_path: Path) -> None:
    filter_save(tmp_path, 0, {"k": jax.random.split(jax.random.key(0), 4)})
    like = {"k": jax.ShapeDtypeStruct((4,), jnp.uint32)}
    with pytest.raises(ValueError, match=r"k  in `like` as \(4,\) uint32  in the checkpoint as"):
        filter_restore(tmp_path, like, jax.devices()[0])


def test_no_checkpoint_and_missing_step(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="found no checkpoint in"):
        filter_restore(tmp_path / "none", abstract_model(), jax.devices()[0])
    filter_save(tmp_path, 1, placed_model())
    with pytest.raises(FileNotFoundError, match=r"no step 2 in .*holds steps \[1\]"):
        filter_restore(tmp_path, abstract_model(), jax.devices()[0], step=2)


def test_no_sharding_to_read_into(tmp_path: Path) -> None:
    filter_save(tmp_path, 1, placed_model())
    with pytest.raises(ValueError, match=r"no sharding to read these leaves(.|\n)*\n  scale\n"):
        filter_restore(tmp_path, abstract_model())
    # shardings of an abstract mesh (from `eval_shape` under `jax.set_mesh`) do not count
    mesh = make_mesh("explicit")
    with jax.set_mesh(mesh):
        like = abstract_model()
    with pytest.raises(ValueError, match="no sharding to read these leaves into"):
        filter_restore(tmp_path, like)


def test_bad_target_is_the_filter_shard_error(tmp_path: Path) -> None:
    filter_save(tmp_path, 1, placed_model())
    with pytest.raises(ValueError, match="filter_restore"):
        filter_restore(tmp_path, abstract_model(), make_mesh("explicit"), P("nope"))


def test_save_errors(tmp_path: Path) -> None:
    model = placed_model()
    filter_save(tmp_path, 1, model)
    with pytest.raises(ValueError, match="step 1 already saved"):
        filter_save(tmp_path, 1, model)
    with pytest.raises(TypeError, match="int `step`, but got str"):
        filter_save(tmp_path, "2", model)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="int `step`, but got bool"):
        filter_save(tmp_path, True, model)
    with pytest.raises(ValueError, match="`step` >= 0, but got -1"):
        filter_save(tmp_path, -1, model)
    with pytest.raises(TypeError, match="`directory` as a `str` or `os.PathLike`"):
        filter_save(3, 2, model)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`max_to_keep` >= 1"):
        filter_save(tmp_path, 2, model, max_to_keep=0)
    with pytest.raises(ValueError, match="no array leaves"):
        filter_save(tmp_path, 2, {"a": "static", "b": 1.0})
    with pytest.raises(ValueError, match=r"share a name:\n  a\.b  \['a'\]\['b'\], \['a\.b'\]"):
        filter_save(tmp_path, 2, {"a.b": jnp.zeros(1), "a": {"b": jnp.ones(1)}})
    assert latest_step(tmp_path) == 1  # nothing was written by the failed calls


def test_save_inside_jit_is_an_error(tmp_path: Path) -> None:
    @jax.jit
    def f(x):
        filter_save(tmp_path, 0, {"x": x})
        return x

    with pytest.raises(TypeError, match=r"cannot save traced leaves(.|\n)*\n  x"):
        f(jnp.zeros(2))


def test_without_orbax_is_an_import_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(sys.modules):
        if name == "orbax" or name.startswith("orbax."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "orbax", None)  # `import orbax...` now raises
    for call in (
        lambda: filter_save(tmp_path, 0, {"a": jnp.zeros(1)}),
        lambda: filter_restore(tmp_path, {"a": jnp.zeros(1)}),
        lambda: latest_step(tmp_path),
    ):
        with pytest.raises(ImportError, match=r"pip install eqxshard\[checkpoint\]"):
            call()


def test_importing_eqxshard_does_not_import_orbax() -> None:
    code = (
        "import sys, eqxshard, eqxshard._checkpoint.save\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'orbax'], 'orbax imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_async_handle_repr(tmp_path: Path) -> None:
    handle = filter_save(tmp_path, 4, {"a": jnp.zeros(2)})
    assert repr(handle) == f"AsyncSave(directory={str(tmp_path)!r}, step=4, done)"
    assert isinstance(handle, eqxshard.AsyncSave)


# ----------------------------------------------------------------------------- hardening


def _run_script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh Python (8 CPU devices), bounded by `timeout` s (a hang fails)."""
    env = without_jax_settings(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(eqxshard.__file__).resolve().parents[1]), env.get("PYTHONPATH")])
    )
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script did not end within {timeout} s; stderr: {e.stderr!r}")


def test_a_background_save_is_finished_when_the_program_ends(tmp_path: Path) -> None:
    """The script's last line starts a save with `wait=False`; the step is on disk."""
    code = (
        "import sys, jax, jax.numpy as jnp, eqxshard\n"
        "eqxshard.filter_save(sys.argv[1], 3, {'w': jnp.arange(512.0**2).reshape(512, 512)},"
        " wait=False)\n"
    )
    done = _run_script(code, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "cannot schedule new futures" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]
    assert latest_step(tmp_path) == 3
    like = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    out = filter_restore(tmp_path, like, jax.devices()[0])
    assert_tree_values(out, {"w": jnp.arange(512.0**2).reshape(512, 512)})


def test_a_failed_background_save_at_exit_is_reported(tmp_path: Path) -> None:
    """A save whose write fails at exit says so on stderr and leaves no temporary dir."""
    code = (
        "import sys, jax.numpy as jnp, eqxshard\n"
        "from eqxshard import _checkpoint\n"
        "h = eqxshard.filter_save(sys.argv[1], 3, {'w': jnp.ones(4)}, wait=False)\n"
        "class Broken:\n"
        "    def wait_until_finished(self): raise OSError('No space left on device')\n"
        "    def close(self): pass\n"
        "h._manager.wait_until_finished()\n"  # the real write is done; a broken one replaces it
        "h._manager.close()\n"
        "h._manager = Broken()\n"
        "h.step = 4\n"
    )
    done = _run_script(code, str(tmp_path))
    assert "background save of step 4" in done.stderr, done.stderr
    assert "NOT on disk: OSError: No space left on device" in done.stderr


def test_failed_saves_end_promptly_and_leave_nothing(tmp_path: Path) -> None:
    """A save into a file and a save of a zero-size leaf fail up front: no temporary
    directory, and no orbax thread keeps Python from exiting (it waited 300 s)."""
    code = (
        "import os, sys, threading, jax.numpy as jnp, eqxshard\n"
        "d = sys.argv[1]\n"
        "open(os.path.join(d, 'file'), 'w').close()\n"
        "for directory, tree in [(os.path.join(d, 'file'), {'w': jnp.ones(4)}),\n"
        "                        (os.path.join(d, 'file', 'sub'), {'w': jnp.ones(4)}),\n"
        "                        (os.path.join(d, 'ckpt'), {'w': jnp.zeros((0, 3))})]:\n"
        "    try:\n"
        "        eqxshard.filter_save(directory, 3, tree)\n"
        "    except (ValueError, NotADirectoryError) as e:\n"
        "        print(type(e).__name__ + ':', str(e).splitlines()[0])\n"
        "print('threads', len(threading.enumerate()))\n"
    )
    done = _run_script(code, str(tmp_path), timeout=90)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("NotADirectoryError: `filter_save` cannot write to `directory`")
    assert "it is a file" in lines[0]
    assert "is inside" in lines[1] and "which is a file" in lines[1]
    assert lines[2].startswith("ValueError: `filter_save` cannot save arrays with a zero-size")
    assert lines[3] == "threads 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_zero_size_leaves_are_rejected_before_anything_is_written(tmp_path: Path) -> None:
    tree = {"a": jnp.zeros((0, 3)), "b": jnp.ones(2), "c": {"d": jnp.zeros((2, 0))}}
    with pytest.raises(ValueError, match=r"zero-size(.|\n)*\n  a +shape \(0, 3\)") as info:
        filter_save(tmp_path / "c", 0, tree)
    assert "c.d  shape (2, 0)" in str(info.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (1.5, TypeError, r"`max_to_keep` as an int >= 1 or None, but got 1\.5 \(float\)"),
        (2.0, TypeError, r"`max_to_keep` as an int >= 1 or None, but got 2\.0 \(float\)"),
        ("3", TypeError, r"`max_to_keep` as an int >= 1 or None, but got '3' \(str\)"),
        (True, TypeError, r"`max_to_keep` as an int"),
        (0, ValueError, r"`max_to_keep` >= 1 or None, but got 0"),
    ],
)
def test_bad_max_to_keep_writes_nothing(tmp_path: Path, value, exc, match) -> None:
    with pytest.raises(exc, match=match):
        filter_save(tmp_path, 1, {"w": jnp.ones(2)}, max_to_keep=value)
    assert not tmp_path.joinpath("1").exists() and latest_step(tmp_path) is None


def _two_steps(tmp_path: Path) -> dict:
    tree = {"w": jnp.arange(4.0), "b": jnp.ones((2, 3))}
    filter_save(tmp_path, 1, tree)
    filter_save(tmp_path, 2, jax.tree.map(lambda x: x + 1, tree))
    return tree


def _like() -> dict:
    return {
        "w": jax.ShapeDtypeStruct((4,), jnp.float32),
        "b": jax.ShapeDtypeStruct((2, 3), jnp.float32),
    }


def _damage(step_dir: Path, how: str) -> str:
    """Damages the saved step `step_dir`; returns what the error must say is wrong."""
    if how == "no _METADATA":
        (step_dir / "default" / "_METADATA").unlink()
        return r"default/_METADATA is missing"
    if how == "garbage _METADATA":
        (step_dir / "default" / "_METADATA").write_text("{not json")
        return r"default/_METADATA is unreadable \(JSONDecodeError"
    if how == "empty":
        for p in sorted(step_dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        return r"_CHECKPOINT_METADATA is missing"
    assert how == "truncated data"
    for p in step_dir.rglob("*"):
        if p.is_file() and p.parent.name == "d":
            p.write_bytes(p.read_bytes()[:5])
    return r"(metadata|array data) is unreadable \(ValueError: "


@pytest.mark.parametrize("how", ["no _METADATA", "garbage _METADATA", "empty", "truncated data"])
def test_a_damaged_step_is_one_clear_error(tmp_path: Path, how: str) -> None:
    tree = _two_steps(tmp_path)
    said = _damage(tmp_path / "2", how)
    like, device = _like(), jax.devices()[0]
    with pytest.raises(ValueError) as info:
        filter_restore(tmp_path, like, device, step=2)
    message = str(info.value)
    assert message.startswith(f"`filter_restore` cannot read step 2 in {tmp_path}: ")
    assert re.search(said, message), message
    assert "The newest good step before it is 1: pass `step=1`" in message
    if how == "truncated data":  # only reading the arrays finds it: the step still counts
        assert latest_step(tmp_path) == 2
        return
    # metadata damage: the step is skipped, once with a warning, then silently
    with pytest.warns(UserWarning, match=rf"skips step 2 in {re.escape(str(tmp_path))}"):
        assert latest_step(tmp_path) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_step(tmp_path) == 1
        assert_tree_values(filter_restore(tmp_path, like, device), tree)
    with pytest.raises(ValueError, match="step 2 already saved \\(damaged\\)"):
        filter_save(tmp_path, 2, tree)


def test_a_failed_read_leaves_no_read_running_past_its_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42: orbax reads a step's arrays in one `asyncio.gather` on an event loop it
    closes when the gather ends. The first read fails; the others (held back here, so
    that they always end after it) used to complete into the closed loop, in
    tensorstore's callback: "Exception ignored ... Event loop is closed", collected by
    whichever test ran next."""
    import tensorstore as ts

    tree = {f"w{i}": jnp.arange(4.0) + i for i in range(3)}
    filter_save(tmp_path, 1, tree)
    _damage(tmp_path / "1", "truncated data")
    opened, timers, ignored = [], [], []
    real_open = ts.open

    def open_late(*args, **kwargs):
        """The first open as it is; each later one ends 0.3 s after tensorstore's."""
        future = real_open(*args, **kwargs)
        opened.append(future)
        if len(opened) == 1:
            return future
        promise, late = ts.Promise.new()

        def finish() -> None:
            try:
                promise.set_result(future.result())
            except Exception as e:
                promise.set_exception(e)

        timers.append(threading.Timer(0.3, finish))
        timers[-1].start()
        return late

    monkeypatch.setattr(ts, "open", open_late)
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    like = {name: jax.ShapeDtypeStruct((4,), jnp.float32) for name in tree}
    with pytest.raises(ValueError, match=r"cannot read step 1 in .*unreadable"):
        filter_restore(tmp_path, like, jax.devices()[0], step=1)
    assert len(opened) > 1 and timers
    for timer in timers:
        timer.join()
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in ignored] == []


def test_a_damaged_first_step_has_no_good_step_before(tmp_path: Path) -> None:
    filter_save(tmp_path, 1, {"w": jnp.ones(4)})
    (tmp_path / "1" / "default" / "_METADATA").unlink()
    with pytest.warns(UserWarning, match="skips step 1"):
        with pytest.raises(
            FileNotFoundError, match=r"no checkpoint in .*damaged steps, skipped: \[1\]"
        ):
            filter_restore(
                tmp_path, {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, jax.devices()[0]
            )
    with pytest.raises(ValueError, match="no good step before it"):
        filter_restore(
            tmp_path, {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, jax.devices()[0], step=1
        )


# ----------------------------------------------------------------------------- faults


def test_a_step_not_complete_once_committed_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second writer of the same step (another process or run) can leave the step
    committed but incomplete; the save that "succeeded" said nothing before."""
    from orbax.checkpoint._src.path import atomicity

    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def clobbered(self, *args, **kwargs):
        await commit(self, *args, **kwargs)
        final = Path(str(self.get_final()))
        if final.name == "2":  # the step directory, once committed
            (final / "default" / "_METADATA").unlink()

    step_dir = re.escape(str(tmp_path / "2"))
    for wait in [True, False]:
        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", clobbered)
        with pytest.raises(
            OSError,
            match=rf"wrote step 2 to .*, but the step is not complete on disk \({step_dir}/"
            rf"default/_METADATA is missing\)\. Another process(.|\n)*delete {step_dir} and",
        ):
            filter_save(tmp_path, 2, {"w": jnp.ones(4)}, wait=wait).wait()
        monkeypatch.undo()
        with pytest.warns(UserWarning, match="eqxshard skips step 2"):
            assert latest_step(tmp_path) is None
        if wait:
            _store._WARNED.clear()
            shutil.rmtree(tmp_path / "2")


@pytest.mark.heavy
def test_ctrl_c_in_a_save_leaves_it_to_be_finished(tmp_path: Path) -> None:
    """Ctrl-C while `filter_save` waits: orbax's threads go on writing. The step is then
    finished by the next save to the directory, or at exit (before, orbax's threads
    were cut off at exit, with pages of tracebacks, and left a temporary directory)."""
    code = (
        "import os, sys, jax.numpy as jnp, eqxshard\n"
        "from eqxshard._checkpoint import async_save\n"
        "real = async_save._wait_for\n"
        "def interrupted(*args):\n"  # Ctrl-C while the step is being written
        "    async_save._wait_for = real\n"
        "    raise KeyboardInterrupt\n"
        "d, tree = sys.argv[1], {'w': jnp.arange(256.0**2).reshape(256, 256)}\n"
        "async_save._wait_for = interrupted\n"
        "try:\n"
        "    eqxshard.filter_save(d, 2, tree)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "eqxshard.filter_save(d, 3, tree)\n"
        "print(sorted(os.listdir(d)))\n"
        "async_save._wait_for = interrupted\n"
        "eqxshard.filter_save(d, 4, tree)\n"  # not caught: Python ends
    )
    done = _run_script(code, str(tmp_path))
    assert done.returncode == -2 and "\nKeyboardInterrupt\n" in done.stderr  # as Ctrl-C ends
    assert done.stdout.splitlines() == ["interrupted", "['2', '3']"]
    assert f"eqxshard: finishing the save of step 4 to {tmp_path} (its wait" in done.stderr
    assert "cannot schedule new futures" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3", "4"]
    assert latest_step(tmp_path) == 4
    like = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    out = filter_restore(tmp_path, like, jax.devices()[0], step=2)
    assert_tree_values(out, {"w": jnp.arange(256.0**2).reshape(256, 256)})


def test_a_directory_that_cannot_be_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(path, exist_ok=False):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(_checkpoint.os, "makedirs", denied)
    with pytest.raises(
        PermissionError,
        match=r"cannot create `directory` .*/run: Permission denied\. Pass a directory",
    ):
        filter_save(tmp_path / "run", 0, {"w": jnp.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_a_save_removes_what_killed_saves_of_earlier_steps_left(tmp_path: Path) -> None:
    """A save killed midway leaves `N.orbax-checkpoint-tmp` (as SIGKILL leaves it); it
    never counts, and orbax's `max_to_keep` never removed it."""
    tree = {"w": jnp.ones(4)}
    for step in [1, 2, 3]:
        filter_save(tmp_path, step, tree)
    for name in ["2.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp", "9.orbax-checkpoint-tmp"]:
        (tmp_path / name / "default.orbax-checkpoint-tmp").mkdir(parents=True)
        (tmp_path / name / "_CHECKPOINT_METADATA").write_text("{}")
    assert latest_step(tmp_path) == 3
    filter_save(tmp_path, 5, tree, max_to_keep=2)
    # Step 2's leftover was pruned in place of step 2 before: three steps were kept.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "5", "9.orbax-checkpoint-tmp"]


@pytest.mark.heavy
def test_a_background_save_is_finished_when_one_process_fails(tmp_path: Path) -> None:
    """An uncaught exception ends a one-process run: the running save is still finished."""
    code = (
        "import sys, jax.numpy as jnp, eqxshard\n"
        "eqxshard.filter_save(sys.argv[1], 3, {'w': jnp.arange(512.0**2).reshape(512, 512)},"
        " wait=False)\n"
        "raise RuntimeError('the training step failed')\n"
    )
    done = _run_script(code, str(tmp_path))
    assert done.returncode == 1 and "RuntimeError: the training step failed" in done.stderr
    assert "cannot schedule new futures" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]
    assert latest_step(tmp_path) == 3
