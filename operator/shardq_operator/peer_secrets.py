"""Each ShardqCluster's peer secret, derived from the operator's key, so it is never read back.

The operator holds one key (`--peer-key-file`, a Secret the chart makes once). A
cluster's secret is HMAC-SHA256 of its namespace, name and uid under that key. So the
operator needs no right to read Secrets: it writes each cluster's (create and patch) and
already knows what it holds. An operator restarted, or a standby taking over, derives
the same secret; a cluster made anew under an old name (a new uid) gets a new one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from shardq.coordination.peer_credentials import PeerCredential

_PURPOSE = b"shardq peer secret"


def cluster_peer_secret(key: PeerCredential, *, namespace: str, cluster: str, uid: str) -> PeerCredential:
    """The peer secret of ShardqCluster `namespace/cluster` (this creation of it, `uid`);
    no secret when the operator has no key."""
    if key.secret is None:
        return PeerCredential()
    message = b"\0".join([_PURPOSE, namespace.encode(), cluster.encode(), uid.encode()])
    digest = hmac.new(key.secret.encode(), message, hashlib.sha256).digest()
    return PeerCredential(base64.urlsafe_b64encode(digest).decode().rstrip("="))


def secret_digest(credential: PeerCredential) -> str:
    """What the server pods' template carries so that a changed secret rolls them (all
    pods then hold the same one), without the secret itself showing in the template."""
    return hashlib.sha256((credential.secret or "").encode()).hexdigest()[:16]
