"""Kubernetes' own syntax rules for names, labels, annotations, tolerations and image references,
written once here so `ppojob validate`, the operator and the trainer apply the same ones (the API
package imports no Kubernetes client).

Each function returns the reasons a value is refused, in the words of its source, empty when it
is valid. Sources (Kubernetes v1.33):
- k8s.io/apimachinery/pkg/util/validation/validation.go: IsQualifiedName, IsValidLabelValue,
  IsDNS1123Label, IsDNS1123Subdomain (and their regular expressions and length limits);
- k8s.io/apimachinery/pkg/api/validation/objectmeta.go: ValidateAnnotations (keys are qualified
  names after lower-casing; TotalAnnotationSizeLimitB = 256 KiB over keys and values);
- k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go: ValidateLabels;
- k8s.io/kubernetes/pkg/apis/core/validation/validation.go: validateTolerations (an empty key
  needs operator Exists; Exists takes no value; tolerationSeconds needs effect NoExecute; an
  Equal value is a label value), ValidatePriorityClassName (a DNS-1123 subdomain),
  validateNFSVolumeSource (an absolute path), and the container image (no leading or trailing
  whitespace; the kubelet refuses what github.com/distribution/reference cannot parse, as
  InvalidImageName).
"""

from __future__ import annotations

import re

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
ANNOTATIONS_MAX_BYTES = 256 * 1024

# github.com/distribution/reference regexp.go, composed as there: a domain (host[:port]) whose
# components may hold upper case, path components of lower case, a tag, a digest.
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_IMAGE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"
)


def dns1123_label(value: str) -> list[str]:
    """IsDNS1123Label (a namespace's name: ValidateNamespaceName)."""
    errs = []
    if len(value) > DNS1123_LABEL_MAX:
        errs.append(f"must be no more than {DNS1123_LABEL_MAX} characters")
    if not _DNS1123_LABEL.match(value):
        errs.append(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or "
            "'-', and must start and end with an alphanumeric character"
        )
    return errs


def dns1123_subdomain(value: str) -> list[str]:
    """IsDNS1123Subdomain."""
    errs = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errs.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX} characters")
    if not _DNS1123_SUBDOMAIN.match(value):
        errs.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
            "'-' or '.', and must start and end with an alphanumeric character"
        )
    return errs


def qualified_name(value: str) -> list[str]:
    """IsQualifiedName: `[prefix/]name`, the prefix a DNS-1123 subdomain, the name at most 63
    characters of alphanumerics, '-', '_' and '.', starting and ending alphanumeric."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        errs = []
    elif len(parts) == 2:
        prefix, name = parts
        errs = (
            ["prefix part must be non-empty"]
            if not prefix
            else [f"prefix part {e}" for e in dns1123_subdomain(prefix)]
        )
    else:
        return [
            "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and "
            "must start and end with an alphanumeric character, with an optional DNS subdomain "
            "prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errs.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if name and not _QUALIFIED_NAME.match(name):
        errs.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character"
        )
    return errs


def label_value(value: str) -> list[str]:
    """IsValidLabelValue: at most 63 characters of alphanumerics, '-', '_' and '.', starting and
    ending alphanumeric (empty is allowed)."""
    errs = []
    if len(value) > LABEL_VALUE_MAX:
        errs.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not _LABEL_VALUE.match(value):
        errs.append(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', "
            "'_' or '.', and must start and end with an alphanumeric character"
        )
    return errs


def annotations_size(annotations: dict[str, str]) -> int:
    """The bytes ValidateAnnotations counts: every key and value."""
    return sum(len(k) + len(v) for k, v in annotations.items())


def image_reference(value: str) -> list[str]:
    """A container image the API server stores and the kubelet can pull by name."""
    if value != value.strip():
        return ["must not have leading or trailing whitespace"]
    if not _IMAGE.match(value):
        return [
            "is not a valid image reference (the kubelet refuses it as InvalidImageName): "
            "[registry[:port]/]lower-case/path[:tag][@sha256:digest], no spaces or upper case "
            "in the path"
        ]
    return []
