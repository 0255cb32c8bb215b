"""Message signatures (docs/wire-contract.md "Signatures"): the signed bytes pinned by test vectors,
checked with libraries other than the platform's own code, and what a verifier refuses."""

from __future__ import annotations

import base64
import json

import nkeys
import pytest
from nacl.signing import VerifyKey

from cdc_platform import cli
from cdc_platform.errors import ConfigError
from cdc_platform.settings import (
    EncodingSettings,
    MirrorSettings,
    OrchestrationSettings,
    PlatformSettings,
    load_settings,
)
from cdc_platform.snapshot.chunks import CHUNK_NUMBER_STRIDE, headers_size
from cdc_platform.snapshot.source import SourceTable, chunk_layout
from cdc_platform.wire import HEADER_SIGNATURE, HEADER_SIGNING_KEY, MessageSigner, SignatureVerifier
from cdc_platform.wire.signing import new_seed, public_key_bytes
from cdc_platform_tests import golden

VECTORS = json.loads(golden.SIGNATURES.read_text())


def test_the_signature_vectors_are_what_the_signer_writes():
    """A failure here is a wire change: make it only on purpose (README, CHANGELOG), then
    rewrite the file with ``python -m cdc_platform_tests.golden``."""
    assert golden.signature_vectors() == golden.SIGNATURES.read_text()


@pytest.mark.parametrize("index", range(len(VECTORS["messages"])))
def test_a_vector_verifies_with_a_plain_ed25519_library(index):
    """What a consumer in another language does: the public nkey decoded by nkeys' own
    code, the signed bytes built by the README's rule, the signature checked by libsodium."""
    vector = VECTORS["messages"][index]
    headers, payload = vector["headers"], bytes.fromhex(vector["payload"])
    seed = bytearray(VECTORS["seed"].encode())
    assert nkeys.from_seed(seed).public_key.decode() == VECTORS["public_key"]
    assert public_key_bytes(VECTORS["public_key"]).hex() == VECTORS["public_key_ed25519"]
    assert headers[HEADER_SIGNING_KEY] == VECTORS["public_key"]
    lines = [vector["subject"], headers["Nats-Msg-Id"],
             *(headers.get(name, "") for name in ("Cdc-Schema-Fingerprint", "Cdc-Claim-Check",
                                                  "Content-Type", "Content-Encoding",
                                                  "Cdc-Zstd-Dict"))]
    expected = b"cdc-platform-signature-v1\n" + "".join(f"{line}\n" for line in lines).encode()
    assert bytes.fromhex(vector["signed_bytes"]) == expected + payload
    signature = base64.urlsafe_b64decode(headers[HEADER_SIGNATURE] + "==")
    VerifyKey(bytes.fromhex(VECTORS["public_key_ed25519"])).verify(
        bytes.fromhex(vector["signed_bytes"]), signature)
    assert SignatureVerifier([VECTORS["public_key"]]).refusal(
        vector["subject"], headers, payload) is None


def _signed(signer: MessageSigner, subject: str, headers: dict[str, str], payload: bytes):
    signature = signer.signature(subject, headers["Nats-Msg-Id"], headers, payload)
    return {**headers, HEADER_SIGNATURE: signature, HEADER_SIGNING_KEY: signer.public_key}


SIGNER = MessageSigner(golden.SIGNING_SEED)
OTHER = MessageSigner(new_seed(bytes(range(1, 33))))
HEADERS = {"Nats-Msg-Id": "7FFFFFFF/FFFFFF00:0", "Cdc-Schema-Fingerprint": "9b5d96cfd7385bfd"}
SUBJECT, PAYLOAD = "cdc.users.insert", b"\x81\xa5table\xa5users"
GOOD = _signed(SIGNER, SUBJECT, HEADERS, PAYLOAD)

REFUSED = {
    "unsigned": (SUBJECT, HEADERS, PAYLOAD, "not signed"),
    "signed by an untrusted key": (SUBJECT, _signed(OTHER, SUBJECT, HEADERS, PAYLOAD), PAYLOAD,
                                   "not a trusted key"),
    "an untrusted key naming a trusted one": (
        SUBJECT, {**_signed(OTHER, SUBJECT, HEADERS, PAYLOAD),
                  HEADER_SIGNING_KEY: SIGNER.public_key}, PAYLOAD, "bad signature"),
    "stored under another subject": ("cdc.users.truncate", GOOD, PAYLOAD, "bad signature"),
    "stored under another message id": (SUBJECT, {**GOOD, "Nats-Msg-Id": "0/1:0"}, PAYLOAD,
                                        "bad signature"),
    "without its message id": (SUBJECT, {k: v for k, v in GOOD.items() if k != "Nats-Msg-Id"},
                               PAYLOAD, "bad signature"),
    "a claim check added": (SUBJECT, {**GOOD, "Cdc-Claim-Check": "cdc_large/x"}, PAYLOAD,
                            "bad signature"),
    "another fingerprint": (SUBJECT, {**GOOD, "Cdc-Schema-Fingerprint": "0" * 16}, PAYLOAD,
                            "bad signature"),
    "another payload": (SUBJECT, GOOD, PAYLOAD + b"x", "bad signature"),
    "a signature that is not one": (SUBJECT, {**GOOD, HEADER_SIGNATURE: "%%%"}, PAYLOAD,
                                    "not a base64url ed25519 signature"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_verifier_refuses(case):
    subject, headers, payload, said = REFUSED[case]
    refusal = SignatureVerifier([SIGNER.public_key]).refusal(subject, headers, payload)
    assert refusal is not None and said in refusal, refusal


def test_several_keys_are_trusted_at_once_while_keys_rotate():
    verifier = SignatureVerifier([OTHER.public_key, SIGNER.public_key])
    assert verifier.refusal(SUBJECT, GOOD, PAYLOAD) is None
    assert verifier.refusal(SUBJECT, _signed(OTHER, SUBJECT, HEADERS, PAYLOAD), PAYLOAD) is None


@pytest.mark.parametrize("key", ["", "ABC", VECTORS["public_key"][:-1] + "A", VECTORS["seed"]])
def test_a_trusted_key_that_is_no_public_nkey_is_refused(key):
    with pytest.raises(ValueError):
        SignatureVerifier([key])


def test_a_signer_refuses_a_public_key_for_a_seed():
    with pytest.raises(ValueError, match="seed"):
        MessageSigner(VECTORS["public_key"])


def test_a_signed_chunk_at_its_payload_budget_still_fits_max_payload():
    """Chunks are cut to the server's max_payload with their headers; a signed one carries
    two more, for which the cut leaves room."""
    max_payload = 1024 * 1024

    def layout(signed: bool):
        return chunk_layout(SourceTable(golden.table_schema(), (), 1, 8192, 1.0),
                            EncodingSettings(), "20261122T100000Z-0a0b0c0d", "1/900",
                            max_payload, None, signed=signed)

    widest = CHUNK_NUMBER_STRIDE * CHUNK_NUMBER_STRIDE - 1
    unsigned = layout(signed=False)
    assert unsigned.payload_budget() + headers_size(unsigned.headers(widest)) == max_payload
    signed = layout(signed=True)
    headers = SIGNER.signed_headers("init.snap.users.x.1", signed.headers(widest), b"")
    assert signed.payload_budget() + headers_size(headers) <= max_payload


def test_a_seed_file_without_a_seed_is_one_config_error_line(tmp_path, monkeypatch):
    seed_file = tmp_path / "not-a-seed"
    seed_file.write_text("SUPER-SECRET-BUT-NOT-A-SEED")
    monkeypatch.setenv("CDC_SIGNING_KEY_SEED", str(seed_file))
    with pytest.raises(ConfigError, match="invalid setting CDC_SIGNING_KEY_SEED: .*no nkey seed") \
            as raised:
        load_settings(PlatformSettings)
    assert "SUPER-SECRET" not in str(raised.value)
    monkeypatch.setenv("CDC_SIGNING_KEY_SEED", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="CDC_SIGNING_KEY_SEED: .*not readable"):
        load_settings(PlatformSettings)


def test_trusted_keys_are_public_nkeys_comma_separated(monkeypatch):
    monkeypatch.setenv("CDC_MIRROR_TRUSTED_KEYS", f" {SIGNER.public_key} , {OTHER.public_key}")
    verifier = load_settings(MirrorSettings).verifier()
    assert set(verifier.keys) == {SIGNER.public_key, OTHER.public_key}
    monkeypatch.setenv("CDC_MIRROR_TRUSTED_KEYS", golden.SIGNING_SEED)  # a seed, not a key
    with pytest.raises(ConfigError, match="invalid setting CDC_MIRROR_TRUSTED_KEYS"):
        load_settings(MirrorSettings)
    monkeypatch.delenv("CDC_MIRROR_TRUSTED_KEYS")
    assert load_settings(MirrorSettings).verifier() is None


def test_the_snapshot_sensor_checks_snapshots_with_public_keys_and_needs_no_seed(
        tmp_path, monkeypatch):
    monkeypatch.delenv("CDC_SIGNING_KEY_SEED", raising=False)
    monkeypatch.delenv("CDC_SIGNING_PUBLIC_KEYS", raising=False)
    assert load_settings(OrchestrationSettings).snapshot_verifier() is None
    monkeypatch.setenv("CDC_SIGNING_PUBLIC_KEYS", f"{SIGNER.public_key},{OTHER.public_key}")
    verifier = load_settings(OrchestrationSettings).snapshot_verifier()
    assert set(verifier.keys) == {SIGNER.public_key, OTHER.public_key}
    monkeypatch.setenv("CDC_SIGNING_PUBLIC_KEYS", golden.SIGNING_SEED)  # a seed, not a key
    with pytest.raises(ConfigError, match="invalid setting CDC_SIGNING_PUBLIC_KEYS"):
        load_settings(OrchestrationSettings)
    monkeypatch.delenv("CDC_SIGNING_PUBLIC_KEYS")
    seed_file = tmp_path / "bridge.seed"  # one environment for all (the dev stack)
    seed_file.write_text(golden.SIGNING_SEED)
    monkeypatch.setenv("CDC_SIGNING_KEY_SEED", str(seed_file))
    verifier = load_settings(OrchestrationSettings).snapshot_verifier()
    assert list(verifier.keys) == [MessageSigner(golden.SIGNING_SEED).public_key]


def test_the_signing_key_command_creates_a_seed_once_and_prints_its_public_key(
        tmp_path, capsys):
    seed_file = tmp_path / "bridge.seed"
    assert cli.main(["signing-key", str(seed_file)]) == 0
    public_key = capsys.readouterr().out.strip()
    assert seed_file.stat().st_mode & 0o777 == 0o600
    assert MessageSigner(seed_file.read_text()).public_key == public_key
    assert cli.main(["signing-key", str(seed_file)]) == 0  # kept, not replaced
    assert capsys.readouterr().out.strip() == public_key


def test_a_mirror_given_a_trusted_key_that_is_none_says_so_before_it_starts(tmp_path):
    # (the command's handler itself: cli.main would take this process's stop signals)
    args = cli.build_parser().parse_args(["mirror", "--tables", "users", "--sqlite",
                                          str(tmp_path / "m.db"), "--trusted-key", "not-a-key"])
    with pytest.raises(ConfigError, match="invalid setting CDC_MIRROR_TRUSTED_KEYS"):
        args.handler(args)
