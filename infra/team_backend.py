"""The stack's ``postgres`` backend (``ppoflow up --backend postgres``): what a team's deployment runs, on loopback.

* **PostgreSQL** (Debian's ``postgresql``): a database cluster of the stack's own under ``<data>/postgres``, started
  by ``up`` on 127.0.0.1 only (no Unix socket), password authentication (SCRAM) for the role ``ppoflow``; the
  databases ``prefect`` and ``mlflow`` hold the Prefect server's and the MLflow server's records.
* **An S3-compatible store** (moto's server, from PyPI): the bucket ``ppoflow`` holds the MLflow server's artifacts
  (``s3://ppoflow/mlartifacts``) and the checkpoints a run writes there
  (``trainer.default_local_dir=s3://ppoflow/...``).
  moto keeps its objects in memory: they last while the stack runs (``down`` ends them; the databases stay). Against
  a real S3 bucket, nothing of ppoflow changes but the endpoint and the credentials.

The password and the S3 keys are made once, at random, and kept in ``<data>/credentials.json`` (mode 0600); they
reach the servers through their environment (``PGPASSWORD``, ``AWS_*``), never a command line or a logged param.
PostgreSQL refuses to run as root: under root, ``up`` runs it (and ``initdb``) as the ``postgres`` user that Debian's
package creates, and the data folder must be one that user can reach.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import subprocess
import time
from pathlib import Path

HOST = "127.0.0.1"
ROLE = "ppoflow"
DATABASES = ("prefect", "mlflow")
BUCKET = "ppoflow"
ARTIFACTS = f"s3://{BUCKET}/mlartifacts"
REGION = "us-east-1"


def credentials(data: Path) -> dict[str, str]:
    """The stack's PostgreSQL password and S3 keys: made at random on first use, then read back."""
    path = data / "credentials.json"
    if path.exists():
        return json.loads(path.read_text())
    made = {
        "postgres_password": secrets.token_urlsafe(24),
        "s3_access_key": "ppoflow-" + secrets.token_hex(6),
        "s3_secret_key": secrets.token_urlsafe(30),
    }
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(made, handle)
    return made


def s3_env(data: Path, s3_port: int) -> dict[str, str]:
    """What an S3 client (boto3, s3fs, MLflow's server) needs to use the stack's store."""
    keys = credentials(data)
    return {
        "AWS_ENDPOINT_URL_S3": f"http://{HOST}:{s3_port}",
        "AWS_ACCESS_KEY_ID": keys["s3_access_key"],
        "AWS_SECRET_ACCESS_KEY": keys["s3_secret_key"],
        "AWS_DEFAULT_REGION": REGION,
    }


def database_url(driver: str, port: int, database: str) -> str:
    """A SQLAlchemy URL without the password (the server reads ``PGPASSWORD``, which libpq and asyncpg honour)."""
    return f"{driver}://{ROLE}@{HOST}:{port}/{database}"


def postgres_program(name: str) -> str:
    """``initdb`` / ``postgres`` of Debian's package (``/usr/lib/postgresql/<version>/bin``, newest first), or on the
    PATH; a RuntimeError saying how to install it otherwise."""
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key, reverse=True)), None
    )
    if found is None:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed: `apt-get install postgresql` (Debian/Ubuntu), then ppoflow up "
            "--backend postgres again"
        )
    return found


def _version_key(path: str) -> int:
    version = Path(path).parent.parent.name
    return int(version) if version.isdigit() else 0


def server_user() -> pwd.struct_passwd | None:
    """The user PostgreSQL runs as: None (this one) unless this process is root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "PostgreSQL refuses to run as root and there is no `postgres` user: install Debian's postgresql package "
            "(it creates one), or run ppoflow up as another user"
        ) from None


def _check_reachable(folder: Path, user: pwd.struct_passwd) -> None:
    for parent in [folder, *folder.parents]:
        info = parent.stat()
        if info.st_uid != user.pw_uid and not info.st_mode & 0o001:
            raise RuntimeError(
                f"PostgreSQL runs as the user {user.pw_name} (it refuses root), who cannot enter {parent} (mode "
                f"{oct(info.st_mode & 0o777)}): give ppoflow up a --data-dir that others can reach (e.g. under /srv "
                f"or /tmp), or `chmod o+x {parent}`"
            )


def as_user(user: pwd.struct_passwd | None):
    """A ``preexec_fn`` running the child as ``user`` (None: as this process)."""
    if user is None:
        return None

    def drop() -> None:
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)

    return drop


def init_cluster(data: Path) -> Path:
    """The stack's PostgreSQL cluster folder, made by ``initdb`` on first use (role ``ppoflow``, SCRAM passwords)."""
    cluster = data / "postgres"
    if (cluster / "PG_VERSION").exists():
        return cluster
    user = server_user()
    if user is not None:
        _check_reachable(data, user)
    cluster.mkdir(mode=0o700)
    password_file = data / "postgres.password"
    password_file.write_text(credentials(data)["postgres_password"])
    try:
        if user is not None:
            os.chown(cluster, user.pw_uid, user.pw_gid)
            os.chown(password_file, user.pw_uid, user.pw_gid)
        done = subprocess.run(
            [
                postgres_program("initdb"),
                "--pgdata",
                str(cluster),
                "--username",
                ROLE,
                "--auth",
                "scram-sha-256",
                "--pwfile",
                str(password_file),
                "--encoding",
                "UTF8",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            preexec_fn=as_user(user),
            cwd=cluster,
        )
    finally:
        password_file.unlink()
    if done.returncode != 0:
        shutil.rmtree(cluster, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    return cluster


def postgres_command(port: int, data: Path) -> tuple[list[str], dict[str, str], str]:
    """(command, extra environment, URL) of the stack's PostgreSQL server: TCP on loopback only, no Unix socket."""
    cluster = init_cluster(data)
    command = [
        postgres_program("postgres"),
        "-D",
        str(cluster),
        "-c",
        f"listen_addresses={HOST}",
        "-c",
        f"port={port}",
        "-c",
        "unix_socket_directories=",
    ]
    return command, {}, f"postgresql://{HOST}:{port}"


def s3_command(port: int, data: Path) -> tuple[list[str], dict[str, str], str]:
    program = shutil.which("moto_server", path=os.path.dirname(os.sys.executable)) or shutil.which("moto_server")
    if program is None:
        raise RuntimeError(
            "the S3-compatible store (moto's server) is not installed: pip install 'ppoflow[team]', then ppoflow up "
            "--backend postgres again"
        )
    return [program, "-H", HOST, "-p", str(port)], {}, f"http://{HOST}:{port}"


def prepare(data: Path, postgres_port: int, s3_port: int, timeout_s: float = 60.0) -> None:
    """The databases ``prefect`` and ``mlflow`` and the bucket ``ppoflow``, made when missing (both servers answer on
    their ports; PostgreSQL may still be starting: retried until ``timeout_s``)."""
    import boto3
    import psycopg

    password = credentials(data)["postgres_password"]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            connection = psycopg.connect(
                host=HOST,
                port=postgres_port,
                user=ROLE,
                password=password,
                dbname="postgres",
                connect_timeout=5,
                autocommit=True,  # CREATE DATABASE runs outside a transaction
            )
            break
        except psycopg.OperationalError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL on port {postgres_port} does not take connections: {error}") from None
            time.sleep(0.5)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT datname FROM pg_database")
            present = {row[0] for row in cursor.fetchall()}
            for database in DATABASES:
                if database not in present:
                    cursor.execute(f'CREATE DATABASE "{database}"')
    finally:
        connection.close()
    env = s3_env(data, s3_port)
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=REGION,
    )
    if BUCKET not in {bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)


def server_env(data: Path, postgres_port: int, s3_port: int) -> dict[str, dict[str, str]]:
    """The environment the Prefect and MLflow servers start with on this backend."""
    password = {"PGPASSWORD": credentials(data)["postgres_password"]}
    return {
        "prefect": {
            **password,
            "PREFECT_API_DATABASE_CONNECTION_URL": database_url("postgresql+asyncpg", postgres_port, "prefect"),
        },
        "mlflow": {**password, **s3_env(data, s3_port), "MLFLOW_S3_ENDPOINT_URL": f"http://{HOST}:{s3_port}"},
    }
