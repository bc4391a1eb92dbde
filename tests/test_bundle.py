"""
L{kcoral.export_bundle} and L{kcoral.models.bundle.read_bundle}: the bundle
folder, written with real C{jax.export} and read back checked.
"""

from __future__ import annotations

import hashlib
import json
import os

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kcoral  # noqa: E402
from kcoral.models.bundle import PARAMS, PROGRAM, BundleError, export_bundle, read_bundle  # noqa: E402
from kcoral.models.manifest import MANIFEST, ModelManifest  # noqa: E402


def mlp_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((16, 32)).astype(np.float32),
            "b1": rng.standard_normal(32).astype(np.float32),
            "w2": rng.standard_normal((32, 8)).astype(np.float32),
            "b2": rng.standard_normal(8).astype(np.float32)}


def mlp(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def export_mlp(folder, name: str = "mlp", **kwargs) -> ModelManifest:
    kwargs.setdefault("batch_sizes", [1, 8])
    return export_bundle(mlp, mlp_params(), np.zeros((2, 16), np.float32), dir=folder, name=name,
                         **kwargs)


def test_mlp_manifest(tmp_path):
    """The manifest names the tensors, their datatypes and batched shapes, the sizes, every file's digest."""
    folder = tmp_path / "mlp"
    manifest = export_mlp(folder)
    assert ModelManifest.loads((folder / MANIFEST).read_bytes()) == manifest
    assert manifest.name == "mlp" and manifest.version == 1
    assert [(t.name, t.datatype, t.shape) for t in manifest.inputs] == [("input", "FP32", (-1, 16))]
    assert [(t.name, t.datatype, t.shape) for t in manifest.outputs] == [("output", "FP32", (-1, 8))]
    assert (manifest.max_batch_size, manifest.batch_sizes) == (8, (1, 8))
    assert manifest.platforms == ("cpu", "cuda")
    assert manifest.params is not None and manifest.params.count == 4
    for file, digest in [(p.file, p.sha256) for p in manifest.programs] + [
            (manifest.params.file, manifest.params.sha256)]:
        assert hashlib.sha256((folder / file).read_bytes()).hexdigest() == digest


def test_symbolic_batch(tmp_path):
    """A row-wise function is exported once, with a symbolic batch, taking flat params then inputs."""
    folder = tmp_path / "mlp"
    manifest = export_mlp(folder)
    assert [(p.file, p.batch_sizes) for p in manifest.programs] == [(PROGRAM, (1, 8))]
    exported = jax.export.deserialize(bytearray((folder / PROGRAM).read_bytes()))
    leaves = jax.tree.leaves(mlp_params())
    assert [a.shape for a in exported.in_avals[:4]] == [leaf.shape for leaf in leaves]
    (batch, features) = exported.in_avals[4].shape
    assert not isinstance(batch, int) and features == 16
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    (y,) = exported.call(*leaves, x)
    np.testing.assert_allclose(y, mlp(mlp_params(), x), rtol=1e-5, atol=1e-6)


def test_one_program_per_size(tmp_path):
    """A function that JAX cannot trace with a symbolic batch gets one program per batch size."""
    def branchy(x):
        # A Python branch on the batch size: undecidable for a symbolic one.
        return x * 2 if x.shape[0] > 1 else x * 2

    manifest = export_bundle(branchy, None, np.zeros((1, 4), np.float32), dir=tmp_path / "b",
                             name="b", batch_sizes=[4, 1])
    assert [(p.file, p.batch_sizes) for p in manifest.programs] == [
        ("program_1.jax", (1,)), ("program_4.jax", (4,))]
    assert read_bundle(tmp_path / "b").programs.keys() == {"program_1.jax", "program_4.jax"}


def test_several_inputs_and_outputs(tmp_path):
    """Several inputs and outputs are named input0, input1, ... and output0, ... in order."""
    manifest = export_bundle(lambda p, a, b: (a + p, b.astype(np.int32)), np.float32(1),
                             np.zeros((1, 3), np.float32), np.zeros((1, 2), np.float16),
                             dir=tmp_path / "m", name="m")
    assert [(t.name, t.datatype) for t in manifest.inputs] == [("input0", "FP32"), ("input1", "FP16")]
    assert [(t.name, t.datatype) for t in manifest.outputs] == [("output0", "FP32"), ("output1", "INT32")]


def test_custom_names(tmp_path):
    """Names given for the inputs and outputs are the manifest's; a wrong count of them is refused."""
    manifest = export_mlp(tmp_path / "mlp", input_names=["pixels"], output_names=["logits"])
    assert [t.name for t in manifest.inputs] == ["pixels"]
    assert [t.name for t in manifest.outputs] == ["logits"]
    with pytest.raises(ValueError, match="2 output names for 1 outputs"):
        export_mlp(tmp_path / "other", output_names=["a", "b"])


def test_bfloat16_params(tmp_path):
    """bfloat16 params are stored as safetensors BF16 and read back bit for bit."""
    params = {k: v.astype(ml_dtypes.bfloat16) for k, v in mlp_params().items()}
    manifest = export_bundle(mlp, params, np.zeros((1, 16), ml_dtypes.bfloat16), dir=tmp_path / "bf",
                             name="bf")
    assert manifest.inputs[0].datatype == "BF16"
    header = (tmp_path / "bf" / PARAMS).read_bytes()
    length = int.from_bytes(header[:8], "little")
    assert {t["dtype"] for k, t in json.loads(header[8:8 + length]).items() if k != "__metadata__"} == {
        "BF16"}
    read = read_bundle(tmp_path / "bf").params
    for got, want in zip(read, jax.tree.leaves(params)):
        assert got.dtype == ml_dtypes.bfloat16 and got.tobytes() == want.tobytes()


def test_no_params(tmp_path):
    """params=None bundles fn(*inputs), with no params file."""
    manifest = export_bundle(lambda x: x * 2, None, np.zeros((1, 4), np.int64 if jax.config.jax_enable_x64
                                                              else np.int32), dir=tmp_path / "d", name="d")
    assert manifest.params is None
    assert sorted(os.listdir(tmp_path / "d")) == [MANIFEST, PROGRAM]
    assert read_bundle(tmp_path / "d").params == []


def test_unserved_dtype_refused(tmp_path):
    """An input or output of a dtype no protocol datatype has is refused with a ValueError naming it."""
    with pytest.raises(ValueError, match="input 0: dtype complex64"):
        export_bundle(lambda x: x, None, np.zeros((1, 2), np.complex64), dir=tmp_path / "c", name="c")
    with pytest.raises(ValueError, match="output 1: dtype complex64"):
        export_bundle(lambda x: (x, x.astype(np.complex64)), None, np.zeros((1, 2), np.float32),
                      dir=tmp_path / "c", name="c")
    assert not (tmp_path / "c").exists()


def test_output_not_batched_refused(tmp_path):
    """An output whose first dimension is not the batch is refused, naming it."""
    with pytest.raises(ValueError, match=r"output 1 has shape \[\] at batch size 1: the first dimension"):
        export_bundle(lambda x: (x, x.sum()), None, np.zeros((1, 2), np.float32), dir=tmp_path / "s",
                      name="s", batch_sizes=[1, 2])


def test_exported_from_kcoral(tmp_path):
    """kcoral.export_bundle is the exporter."""
    assert kcoral.export_bundle is export_bundle
    assert "export_bundle" in kcoral.__all__


def test_read_bundle(tmp_path):
    """read_bundle returns the manifest, the programs' bytes and the params in leaves order."""
    manifest = export_mlp(tmp_path / "mlp")
    bundle = read_bundle(tmp_path / "mlp")
    assert bundle.manifest == manifest
    assert bundle.programs == {PROGRAM: (tmp_path / "mlp" / PROGRAM).read_bytes()}
    for got, want in zip(bundle.params, jax.tree.leaves(mlp_params()), strict=True):
        np.testing.assert_array_equal(got, want)


def test_flipped_byte_refused(tmp_path):
    """A params file whose bytes changed is refused, naming the file and its digest."""
    export_mlp(tmp_path / "mlp")
    path = tmp_path / "mlp" / PARAMS
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{PARAMS}: its SHA-256 is"):
        read_bundle(tmp_path / "mlp")


def test_missing_file_refused(tmp_path):
    """A program file that is missing is refused, naming it."""
    export_mlp(tmp_path / "mlp")
    (tmp_path / "mlp" / PROGRAM).unlink()
    with pytest.raises(BundleError, match=f"{PROGRAM}: cannot open it: No such file"):
        read_bundle(tmp_path / "mlp")


def test_broken_manifest_refused(tmp_path):
    """A model.json that is not JSON, or not a manifest, is refused, saying so."""
    export_mlp(tmp_path / "mlp")
    manifest = tmp_path / "mlp" / MANIFEST
    value = json.loads(manifest.read_bytes())
    manifest.write_bytes(b"{")
    with pytest.raises(BundleError, match=f"{MANIFEST}: {MANIFEST} is not JSON"):
        read_bundle(tmp_path / "mlp")
    manifest.write_text(json.dumps({**value, "max_batch_size": 4}))
    with pytest.raises(BundleError, match="sizes from 1 to max_batch_size"):
        read_bundle(tmp_path / "mlp")


def test_path_refused(tmp_path):
    """A file name with a slash, pointing out of the folder, is refused."""
    export_mlp(tmp_path / "mlp")
    (tmp_path / "secret").write_bytes(b"x")
    manifest = tmp_path / "mlp" / MANIFEST
    value = json.loads(manifest.read_bytes())
    value["programs"][0]["file"] = "../secret"
    manifest.write_text(json.dumps(value))
    with pytest.raises(BundleError, match="must be a file name in the bundle"):
        read_bundle(tmp_path / "mlp")


def test_symlink_refused(tmp_path):
    """A bundle file that is a link, even to a file with the right digest, is refused."""
    export_mlp(tmp_path / "mlp")
    moved = tmp_path / "elsewhere"
    os.replace(tmp_path / "mlp" / PARAMS, moved)
    os.symlink(moved, tmp_path / "mlp" / PARAMS)
    with pytest.raises(BundleError, match=f"{PARAMS}: a link"):
        read_bundle(tmp_path / "mlp")


def test_wrong_params_count_refused(tmp_path):
    """A params file with other tensors than the manifest counts is refused."""
    export_mlp(tmp_path / "mlp")
    manifest = tmp_path / "mlp" / MANIFEST
    value = json.loads(manifest.read_bytes())
    value["params"]["count"] = 3
    manifest.write_text(json.dumps(value))
    with pytest.raises(BundleError, match=f"{PARAMS}: holds 4 tensors, {MANIFEST} says 3"):
        read_bundle(tmp_path / "mlp")


def test_bundle_files_take_the_users_umask(tmp_path):
    """A bundle's files get the mode of any file their user creates (0666 less the umask):
    with umask 027 the group can read them, so another account of the group can serve them."""
    old = os.umask(0o027)
    try:
        export_mlp(tmp_path / "mlp")
    finally:
        os.umask(old)
    modes = {entry.name: entry.stat().st_mode & 0o777 for entry in os.scandir(tmp_path / "mlp")}
    assert modes and all(mode == 0o640 for mode in modes.values()), modes
