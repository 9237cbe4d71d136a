"""Names that become path components or artifact names: one definition, matched in full.

Every check uses ``fullmatch`` (``re.match`` with ``$`` accepts a trailing newline, which would
then reach a path or a log line). Kubernetes names come from annotations and pod metadata:
untrusted until they pass here.
"""

from __future__ import annotations

import re

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # namespaces, container names
ARTIFACT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")
# A Kubernetes object name as a status file's path component (pod names are DNS subdomains).
STATUS_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
MAX_LABEL = 63


def is_dns_label(value: str) -> bool:
    return len(value) <= MAX_LABEL and DNS_LABEL.fullmatch(value) is not None


def is_artifact_name(value: str) -> bool:
    return len(value) <= MAX_LABEL and ARTIFACT_NAME.fullmatch(value) is not None


def is_pod_uid(value: str) -> bool:
    return POD_UID.fullmatch(value) is not None


def is_status_component(value: str) -> bool:
    return STATUS_COMPONENT.fullmatch(value) is not None
