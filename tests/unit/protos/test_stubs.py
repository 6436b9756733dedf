"""Generated gRPC stubs: committed output matches the .proto sources, and the modules import and agree."""

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.serve_config import GRPC_SERVICER_FUNCTIONS
from protos import generate

REPO_ROOT = Path(generate.__file__).resolve().parent.parent


def test_committed_stubs_match_protos():
    result = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fresh")
    generate.generate(out)
    return out


def test_generation_covers_every_proto(fresh):
    files = {str(p) for p in generate.generated_files(fresh)}
    for source in generate.proto_files():
        stem = str(source.with_suffix(""))
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= files
    assert {"warmpath/__init__.py", "warmpath/v1/__init__.py"} <= files


def _drop(root: Path) -> str:
    (root / "warmpath/v1/agent_pb2_grpc.py").unlink()
    return "missing: warmpath/v1/agent_pb2_grpc.py"


def _edit(root: Path) -> str:
    path = root / "warmpath/v1/inference_pb2.py"
    path.write_text(path.read_text() + "# hand edit\n")
    return "differs: warmpath/v1/inference_pb2.py"


def _extra(root: Path) -> str:
    (root / "warmpath/v1/old_pb2.py").write_text("")
    return "not generated from any .proto: warmpath/v1/old_pb2.py"


@pytest.mark.parametrize("mutate", [_drop, _edit, _extra], ids=["missing", "edited", "stale"])
def test_check_reports_drift(fresh, tmp_path, mutate):
    committed = tmp_path / "gen"
    committed.mkdir()
    generate.generate(committed)
    assert generate.find_drift(fresh, committed) == []
    expected = mutate(committed)
    assert generate.find_drift(fresh, committed) == [expected]


def test_check_mode_fails_on_drift(tmp_path, monkeypatch, capsys):
    generate.generate(tmp_path)
    _edit(tmp_path)
    monkeypatch.setattr(generate, "GEN_ROOT", tmp_path)
    assert generate.main(["--check"]) == 1
    assert "differs: warmpath/v1/inference_pb2.py" in capsys.readouterr().err


def _methods(service) -> dict[str, bool]:
    """Method name -> server-streaming, from the service descriptor."""
    return {m.name: m.server_streaming for m in service.methods}


def test_services_and_streaming_shape():
    from warmpath.v1 import agent_pb2, inference_pb2

    inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    agent = agent_pb2.DESCRIPTOR.services_by_name["Agent"]
    assert inference.full_name == "warmpath.v1.Inference"
    assert _methods(inference) == {"ChatCompletion": False, "StreamChatCompletion": True}
    assert _methods(agent) == {
        "CreateSession": False,
        "SendMessage": True,
        "SubmitToolResults": True,
        "GetSession": False,
        "DeleteSession": False,
    }
    assert not any(m.client_streaming for s in (inference, agent) for m in s.methods)


def test_method_names_unique_across_services():
    # Ray Serve's gRPC proxy dispatches on the method name alone.
    from warmpath.v1 import agent_pb2, inference_pb2

    names = [m.name for pb in (inference_pb2, agent_pb2) for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("path", GRPC_SERVICER_FUNCTIONS)
def test_servicer_functions_importable(path):
    # The import paths the Serve config lists in grpc_options.grpc_servicer_functions.
    from ray._common.utils import import_attr

    assert callable(import_attr(path))


def test_every_folder_above_a_proto_is_a_regular_package(tmp_path, monkeypatch):
    """setuptools installs regular packages only: a folder between the root and a source needs its own
    `__init__.py`, not just the folders holding sources."""
    sources = tmp_path / "src"
    nested = sources / generate.SOURCE_PACKAGE / "v2" / "ext"
    nested.mkdir(parents=True)
    (nested / "x.proto").write_text('syntax = "proto3";\npackage warmpath.v2.ext;\nmessage X {}\n')
    monkeypatch.setattr(generate, "PROTO_ROOT", sources)
    out = tmp_path / "out"
    out.mkdir()
    generate.generate(out)
    for package in ("warmpath", "warmpath/v2", "warmpath/v2/ext"):
        assert (out / package / "__init__.py").is_file(), package
