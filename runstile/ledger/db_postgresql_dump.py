"""`runstile db backup` of a PostgreSQL ledger: ``pg_dump --format=custom``
(docs/operations.md, "Backups").

pg_dump reads its database in one repeatable-read snapshot, so the dump is the ledger at
one instant while runstile keeps writing; ``pg_restore`` into an empty database gives
it back.  The password never reaches pg_dump's argv (which any local user can read in
ps): the connection string it gets is the URL without its password, plus the
``passfile`` connection parameter naming a 0600 file in a 0700 temporary directory that
holds the password alone and is removed when pg_dump ends.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from ..errors import ConfigError, LedgerUnavailable, redact_url
from ..filemodes import private_dir, private_file


def dump(url: str, target: Path) -> int:
    """Dump the ledger at ``url`` to ``target`` (custom format); return its size in bytes.
    ConfigError when pg_dump is not on PATH, LedgerUnavailable when it fails."""
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        raise ConfigError("pg_dump is not on PATH: `runstile db backup` of a PostgreSQL "
                          "ledger runs it (install the PostgreSQL client programs, of the "
                          "server's major version or newer)")
    private_dir(target.parent)
    private_file(target)  # every tenant's data: 0600 like the ledger (pg_dump keeps the mode)
    with tempfile.TemporaryDirectory(prefix="runstile-pgpass-") as folder:
        conninfo = _without_password(url, Path(folder) / "pgpass")
        done = subprocess.run(
            [pg_dump, "--format=custom", "--no-password", f"--file={target}",
             f"--dbname={conninfo}"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        password = _password(url)
        # pg_dump's stderr on one line (its error, then libpq's detail lines).
        said = " ".join(line.strip() for line in done.stderr.splitlines() if line.strip())
        said = said[:1000] or "(nothing on stderr)"
        if password:
            said = said.replace(password, "***")
        raise LedgerUnavailable(f"pg_dump of {redact_url(url)} failed "
                                f"(exit {done.returncode}): {said}")
    return target.stat().st_size


def _password(url: str) -> str | None:
    raw = urlsplit(url).password
    return None if raw is None else unquote(raw)


def _without_password(url: str, passfile: Path) -> str:
    """``url`` without its password; if it had one, written to ``passfile`` (0600) and
    named by the URL's ``passfile`` parameter."""
    parts = urlsplit(url)
    password = _password(url)
    if password is None:
        return url
    private_file(passfile)
    # A .pgpass line: host:port:database:user:password, '*' matching anything; ':' and
    # '\' in the password escaped with '\'.
    escaped = password.replace("\\", "\\\\").replace(":", "\\:")
    passfile.write_text(f"*:*:*:*:{escaped}\n", encoding="utf-8")
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
    query = "&".join(q for q in (parts.query, f"passfile={quote(str(passfile))}") if q)
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc}" if user else netloc,
                                     query=query))
