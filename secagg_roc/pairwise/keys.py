"""Key agreement, key derivation and authenticated encryption for pairwise masking.

Each Site makes two fresh X25519 key pairs per round: `c` to encrypt the
secret shares it sends to its neighbours through the server, `s` to agree on
pairwise masks. Every derived key goes through HKDF-SHA256 with a label, the
round id and the (ordered) pair of site ids, so a key agreed for one purpose,
round or pair is never reused for another. Shares travel under AES-256-GCM
whose associated data binds sender, receiver and round: the server that relays
them can neither read nor redirect nor replay them into another round.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .. import prg
from .errors import MessageError, ShareAuthenticationError

KEY_BYTES = 32  # X25519 private and public keys, agreed secrets, self-mask seeds
NONCE_BYTES = 12
TAG_BYTES = 16
_ID = struct.Struct("<Q")


def new_key_pair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 key pair (private key object, raw 32-byte public key). Run by a Site."""
    sk = X25519PrivateKey.generate()
    return sk, sk.public_key().public_bytes_raw()


def private_bytes(sk: X25519PrivateKey) -> bytes:
    """The raw 32-byte private key (what a Site Shamir-shares among its neighbours)."""
    return sk.private_bytes_raw()


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    """A private key from its raw 32 bytes (as reconstructed by the server)."""
    if len(raw) != KEY_BYTES:
        raise MessageError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def public_of(sk: X25519PrivateKey) -> bytes:
    """The raw public key of `sk`."""
    return sk.public_key().public_bytes_raw()


def agree(sk: X25519PrivateKey, peer_public: bytes) -> bytes:
    """The raw X25519 shared secret with `peer_public`; refuses malformed or low-order keys."""
    if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES:
        raise MessageError(f"an X25519 public key is {KEY_BYTES} bytes")
    try:
        return sk.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # an all-zero shared secret: a low-order point, i.e. a crafted key
        raise MessageError("refused an X25519 public key of low order (its shared secret would be zero)") from None


def check_public(public: bytes) -> None:
    """Refuse a public key no honest peer could agree with (malformed, or of low order). Run by the server
    as keys arrive, so one site's bad key is its own refusal, not every neighbour's failed round."""
    agree(X25519PrivateKey.generate(), public)


def _info(label: bytes, round_id: bytes, *sites: int) -> bytes:
    # Length-prefixed so that no (label, round, ids) triple can collide with another.
    return label + struct.pack("<I", len(round_id)) + round_id + b"".join(_ID.pack(s) for s in sites)


def derive(secret: bytes, length: int, label: bytes, round_id: bytes, *sites: int) -> bytes:
    """HKDF-SHA256 of `secret`, bound to a purpose label, the round and the sites."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None,
                info=_info(label, round_id, *sites)).derive(secret)


def pair_mask_seed(shared: bytes, round_id: bytes, u: int, v: int) -> bytes:
    """The 16-byte PRG seed of the pairwise mask between sites u and v (symmetric in u, v)."""
    return derive(shared, prg.SEED_BYTES, b"secagg-roc/pairwise/mask", round_id, min(u, v), max(u, v))


def self_mask_seed(b: bytes, round_id: bytes, u: int) -> bytes:
    """The 16-byte PRG seed of site u's self mask, from its 32-byte secret b_u."""
    return derive(b, prg.SEED_BYTES, b"secagg-roc/pairwise/self-mask", round_id, u)


def channel_key(shared: bytes, round_id: bytes, u: int, v: int) -> bytes:
    """The AES-256-GCM key for shares between sites u and v (symmetric in u, v)."""
    return derive(shared, 32, b"secagg-roc/pairwise/channel", round_id, min(u, v), max(u, v))


def _aad(round_id: bytes, sender: int, receiver: int) -> bytes:
    return _info(b"secagg-roc/pairwise/share", round_id, sender, receiver)


def seal(key: bytes, round_id: bytes, sender: int, receiver: int, plaintext: bytes) -> tuple[bytes, bytes]:
    """(nonce, ciphertext) of `plaintext` from `sender` to `receiver`. Run by a Site.

    A random 96-bit nonce is safe: each key encrypts at most two messages (one each way)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce, AESGCM(key).encrypt(nonce, plaintext, _aad(round_id, sender, receiver))


def open_sealed(key: bytes, round_id: bytes, sender: int, receiver: int, nonce: bytes, ciphertext: bytes) -> bytes:
    """The plaintext, or `ShareAuthenticationError` if anything was changed. Run by a Site."""
    if len(nonce) != NONCE_BYTES:
        raise MessageError(f"a share nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    try:
        return AESGCM(key).decrypt(nonce, ciphertext, _aad(round_id, sender, receiver))
    except InvalidTag:
        raise ShareAuthenticationError(
            f"the encrypted share from site {sender} to site {receiver} failed authentication "
            "(AES-GCM InvalidTag): it was tampered with, misrouted, or belongs to another round"
        ) from None
