"""Hostile-input corpus, part 3: the classes a second round of hostile use still found (issue 16, section 5): bytes
that are not UTF-8, a tracking URI that answers but is not MLflow, ids Python would read as digit groups, and a
rejected command that leaves a state directory behind. Same contract as part 2 (bad_input_kit.assert_rejected)."""
from __future__ import annotations

import base64
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

from bad_input_kit import GOOD_STUDY, assert_rejected
from test_postgres import pg_db, pg_url  # noqa: F401 - pg_db is a fixture, used by name
from latentsweep.search.cli.main import main
from latentsweep.search.tracking.probe import probe_tracking_store as _probe_tracking_server
from latentsweep.trainers.eval.submission import write_submission


class _Answer(http.server.BaseHTTPRequestHandler):
    """Answers every GET as the server's `reply` says: (status, content type, body), or MLflow-like JSON only to
    the Basic credentials in `needs_auth`."""

    def do_GET(self):  # noqa: N802 - the http.server API
        server = self.server
        status, kind, body = server.reply
        if server.needs_auth and self.headers.get("Authorization") != f"Basic {server.needs_auth}":
            status, kind, body = 401, "text/plain", b"credentials required"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(status: int, kind: str, body: bytes, needs_auth: str = "") -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        server.reply, server.needs_auth = (status, kind, body), needs_auth
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _npz_with(src: Path, dst: Path, key: str, row: int, raw: bytes) -> Path:
    arrays = dict(np.load(src))
    values = [v.encode() for v in arrays[key].tolist()]
    values[row] = raw
    arrays[key] = np.array(values, dtype="S")
    np.savez(dst, **arrays)
    return dst


NOT_UTF8 = {  # key, row, bytes: latin-1 and a lone continuation byte
    "names_latin1": ("images/names", 2, "caf\xe9".encode("latin-1")),
    "text_continuation": ("captions/text", 9, b"a photo \x80 of"),
}


@pytest.mark.parametrize("case", sorted(NOT_UTF8))
@pytest.mark.parametrize("command", ["data", "train", "worker"])
def test_npz_strings_that_are_not_utf8(case, command, data, existing, tmp_path, capsys):
    key, row, raw = NOT_UTF8[case]
    bad = _npz_with(data["train"], tmp_path / f"{case}.npz", key, row, raw)
    argv = {"data": ["data", "check", str(bad)],
            "train": ["train", str(existing["study_file"]), "--data", str(bad), "--out", str(tmp_path / "o"),
                      "--quiet"],
            "worker": ["worker", str(existing["study_file"]), "--data", str(bad), "--state-dir",
                       str(existing["state"])]}[command]
    assert_rejected(capsys, main(argv), existing, f"{case}.npz", f"'{key}'", f"row {row} is not UTF-8 text",
                    absent=[tmp_path / "o"])


def test_npz_strings_in_utf8_beyond_ascii_load(data, tmp_path, capsys):
    good = _npz_with(data["train"], tmp_path / "accents.npz", "images/names", 2, "café".encode())
    assert main(["data", "check", str(good)]) == 0


STUDY_NOT_UTF8 = {  # where the stray byte is, the line it is reported on
    "description": (GOOD_STUDY.replace("n_trials = 1", 'n_trials = 1\ndescription = "caf\xe9"'), 5),
    "enqueue": (GOOD_STUDY + '\n[[enqueue]]\n"optim.lr" = 0.001  # r\xe9glage\n', 25),
}


@pytest.mark.parametrize("case", sorted(STUDY_NOT_UTF8))
@pytest.mark.parametrize("command", ["run", "create", "train"])
def test_study_files_that_are_not_utf8(case, command, data, existing, tmp_path, capsys):
    text, line = STUDY_NOT_UTF8[case]
    path = tmp_path / "latin1.toml"
    path.write_bytes(text.encode("latin-1"))
    argv = (["train", str(path), "--data", str(data["train"]), "--out", str(tmp_path / "o"), "--quiet"]
            if command == "train" else
            ["study", command, str(path), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    assert_rejected(capsys, main(argv), existing, f"{path}: line {line}: not UTF-8 text (byte 0xe9)",
                    absent=[tmp_path / "o"])


NOT_MLFLOW = {  # what answers at the tracking URI, the fragment of the one-line error
    "not_found": ((404, "text/html", b"<h1>Not Found</h1>"), "(HTTP 404 for its experiments API)"),
    "html_page": ((200, "text/html", b"<html>a web server</html>"), "did not return JSON"),
    "method": ((405, "text/plain", b"no"), "(HTTP 405"),
}


@pytest.mark.parametrize("case", sorted(NOT_MLFLOW))
def test_tracking_uri_that_answers_but_is_not_mlflow(case, serve, data, existing, tmp_path, capsys):
    reply, fragment = NOT_MLFLOW[case]
    uri = serve(*reply)
    argv = ["study", "run", str(existing["study_file"]), "--data", str(data["train"]), "--state-dir",
            str(existing["state"]), "--tracking-uri", uri]
    assert_rejected(capsys, main(argv), existing, f"{uri} answers but is not an MLflow tracking server", fragment)


def test_tracking_uri_with_credentials_that_answers_is_reachable(serve):
    uri = serve(200, "application/json", b'{"experiments": []}', base64.b64encode(b"user:p@ss").decode())
    _probe_tracking_server(uri.replace("http://", "http://user:p%40ss@"))  # no error: it answered, as MLflow
    with pytest.raises(Exception, match="answers but is not an MLflow") as err:  # answered, so not "unreachable"
        _probe_tracking_server(serve(404, "text/plain", b"").replace("http://", "http://user:pw@"))
    assert "pw" not in str(err.value)


def test_submission_id_with_digit_grouping(data, existing, tmp_path, capsys):
    ids = np.load(data["test"])["captions/ids"]
    path = tmp_path / "sub.csv"
    write_submission(path, ids, np.ones((len(ids), 12), np.float32))
    head, first, *rest = path.read_text().splitlines()
    grouped = first.replace(f"{ids[0]},", f"0_{ids[0]},", 1)
    path.write_text("\n".join([head, grouped, *rest]) + "\n")
    assert_rejected(capsys, main(["submission", "check", str(path), "--test", str(data["test"])]), existing,
                    f"line 2: id '0_{ids[0]}' is not an integer")


def test_a_rejected_study_run_leaves_no_state_directory(existing, tmp_path, capsys):
    fresh = tmp_path / "fresh-state"
    argv = ["study", "run", str(existing["study_file"]), "--data", str(tmp_path / "nope.npz"), "--state-dir",
            str(fresh)]
    assert_rejected(capsys, main(argv), existing, "nope.npz: file not found", absent=[fresh])


def test_a_database_tracking_uri_without_artifact_root_fails_before_the_study_is_stored(data, existing, tmp_path,
                                                                                        pg_db, capsys):
    """A server database has no directory for artifacts (SQLite keeps them beside its file): the missing root is
    said before the Optuna study is stored, and MLflow's tables are not created."""
    import sqlalchemy as sa

    storage = tmp_path / "optuna.db"
    argv = ["study", "run", str(existing["study_file"]), "--data", str(data["train"]), "--state-dir",
            str(existing["state"]), "--storage", f"sqlite:///{storage}", "--tracking-uri", pg_url(pg_db)]
    assert_rejected(capsys, main(argv), existing, "is a database and has no experiment 'badinput' yet",
                    "an artifact root is required", absent=[storage])
    engine = sa.create_engine(pg_url(pg_db), poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        assert not sa.inspect(conn).has_table("experiments")
    engine.dispose()


@pytest.mark.parametrize("entries", [129, 10_000])
def test_a_space_with_too_many_entries_is_refused_at_once(entries, data, existing, tmp_path, capsys):
    import time

    from bad_input_kit import problem_lines

    extra = "".join(f'"optim.weight_decay#b{i}" = {{ type = "float", low = 0.0, high = 0.1, '
                    f'when = "optim.lr > {1e-4 + i * 1e-6}" }}\n' for i in range(entries - 1))
    path = tmp_path / "wide.toml"
    path.write_text(GOOD_STUDY + extra)
    start = time.monotonic()
    code = main(["study", "run", str(path), "--data", str(data["train"]), "--state-dir", str(existing["state"])])
    assert time.monotonic() - start < 30
    (problem,) = problem_lines(capsys, code, path)
    assert f"space has {entries} entries; at most 128 are supported" in problem


def _npz_changed(src: Path, dst: Path, change) -> Path:
    arrays = dict(np.load(src))
    change(arrays)
    np.savez(dst, **arrays)
    return dst


def _one_image(arrays) -> None:
    keep = arrays["captions/label"][:, 0]
    for key in ("captions/ids", "captions/text", "captions/embeddings"):
        arrays[key] = arrays[key][keep]
    arrays["captions/label"] = arrays["captions/label"][keep][:, :1]
    arrays["images/names"], arrays["images/embeddings"] = arrays["images/names"][:1], arrays["images/embeddings"][:1]
    arrays["metadata/num_images"], arrays["metadata/num_captions"] = np.array([1]), np.array([int(keep.sum())])


def _beyond_float32(arrays) -> None:
    arrays["captions/embeddings"] = arrays["captions/embeddings"].astype(np.float64)
    arrays["captions/embeddings"][3, 2] = 1e300


MINOR_DATA = {  # the file change, the fragments of the one-line error of `data check` (and of `train`)
    "one_image": (_one_image, ["'images/embeddings'", "has 1 image; a train file needs at least 2"]),
    "beyond_float32": (_beyond_float32, ["'captions/embeddings'", "row 3", "beyond the float32 range"]),
}


@pytest.mark.parametrize("case", sorted(MINOR_DATA))
@pytest.mark.parametrize("command", ["data", "train"])
def test_data_check_rejects_what_train_rejects_in_one_line(case, command, data, existing, tmp_path, capsys):
    change, fragments = MINOR_DATA[case]
    bad = _npz_changed(data["train"], tmp_path / f"{case}.npz", change)
    argv = (["data", "check", str(bad)] if command == "data" else
            ["train", str(existing["study_file"]), "--data", str(bad), "--out", str(tmp_path / "o"), "--quiet"])
    with np.errstate(over="raise"):  # the overflow RuntimeWarning must not print before the error line
        assert_rejected(capsys, main(argv), existing, *fragments, absent=[tmp_path / "o"])


def test_a_failed_predict_names_the_path_the_user_gave(data, existing, tmp_path, capsys):
    out = tmp_path / "pred.csv"
    out.mkdir()  # the rename onto it fails: the error must name it, not the hidden temporary file beside it
    argv = ["predict", str(existing["checkpoint"]), "--test", str(data["test"]), "--out", str(out)]
    line = assert_rejected(capsys, main(argv), existing, f"error: {out}: ")
    assert ".tmp" not in line and list(tmp_path.iterdir()) == [out]
