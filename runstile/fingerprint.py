"""Request fingerprints (SPEC §3.1): SHA-256 of the RFC 8785 (JCS) canonical body.

The version is stored with every fingerprint so that a future change of normalisation
can compare old records with the old rules instead of refusing honest retries.
"""

from __future__ import annotations

import hashlib

import rfc8785

#: Bump when normalisation or canonicalisation changes; stored with each record.
FINGERPRINT_VERSION = 1
#: The body fields that take part, each normalised to null when absent.
FIELDS = ("task", "input", "run_id", "session_key", "trigger_id", "callback_url", "metadata")


class NotCanonicalisable(ValueError):
    """Raised when a body holds a value JCS cannot represent (an integer beyond 2**53)."""


def fingerprint(normalised: dict) -> str:
    """Hex SHA-256 of the canonical form of ``normalised`` (every FIELDS key present)."""
    try:
        canonical = rfc8785.dumps({name: normalised.get(name) for name in FIELDS})
    except (rfc8785.CanonicalizationError, ValueError, TypeError) as exc:
        raise NotCanonicalisable(str(exc)) from None
    return hashlib.sha256(canonical).hexdigest()
