"""Personal data out of the text before a model can memorize it: e-mail addresses, IP addresses and phone numbers
become placeholders, and the step counts, per kind, the documents it changed and the matches it replaced
(`stats.changed["email"]`, `stats.changed["email replacements"]`), as datatrove's PII formatter does.

What counts as each kind, and what is left alone on purpose (false positives cost good text):

- email: a local part of ASCII letters, digits and ._%+- , an @, and a dotted domain whose last label is 2+
  letters. "user@host" without a top-level domain and image names like "logo@2x.png" are not addresses.
- ip_address: dotted IPv4 (each part 0..255, no leading zeros) and IPv6 (eight groups, or a "::" form with at
  least three groups and a digit, checked by `ipaddress`). A dotted quad inside a longer dotted number
  (1.2.3.4.5), glued to a letter (v1.2.3.4) or after "version", "release", "section" or 版本 is a version or
  a section number and stays. By default only public (globally routable) addresses go: 192.168.0.1 in a
  router manual is not anybody's address.
- phone_number: an international number (+ and a country code, 8 to 15 digits in all, spaces, dots, dashes or
  a parenthesised group between them); a North American one with an area code ((212) 555-0123,
  212-555-0123); a national one with a trunk 0 and a separator (020 7946 0958, 010-12345678, (0755) 1234567);
  a Chinese mobile number (13800138000, 138-0013-8000: 11 digits starting 13..19). Dates (2024-01-15,
  2024.01.15), decimals (3.14159265358), number ranges (1990-2000), ISBNs and bare digit runs of other
  lengths do not match: every pattern wants a phone's grouping, and none may touch a further digit, letter
  or decimal point.

Patterns are ASCII-only (`re.ASCII`): Chinese text around a number is not a "word character", so
"电话13800138000" is found, while full-width digits are not read as digits.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import replace

from liandan.data.documents.corpus import Document
from liandan.data.steps.base import Transform, register

KINDS = ("email", "ip_address", "phone_number")

_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
    r"([A-Za-z]{2,24})(?![A-Za-z0-9-]|\.[A-Za-z0-9])",
    re.ASCII,
)
# File suffixes that follow an "@" in asset names (icon@2x.png) and are not top-level domains anyone mails to.
_FILE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "bmp", "ico", "pdf"})

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?!\w|\.\d)", re.ASCII)
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:]|\.\d)", re.ASCII)
# Words right before a dotted quad that make it a version or a section number.
_NOT_AN_ADDRESS = re.compile(
    r"(?:version|release|build|firmware|section|chapter|rule|clause|§|版本|版|第)[\s:：=#]*(?:is\s+|of\s+)?$",
    re.IGNORECASE,
)

_INTERNATIONAL = r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\)|[ .-]?\d{1,5}){1,6}"
_NORTH_AMERICAN = r"(?:1[ .-])?(?:\([2-9]\d\d\) ?|[2-9]\d\d[ .-])\d{3}[.-]\d{4}"
_NATIONAL_TRUNK = r"(?:\(0\d{1,4}\) ?|0\d{1,4}[ -])\d{3,4}[ -]?\d{3,4}"
_CHINESE_MOBILE = r"(?:(?:\+86|0086)[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}"
_PHONE = re.compile(
    rf"(?<![\w+.,-])(?:{_INTERNATIONAL}|{_NORTH_AMERICAN}|{_NATIONAL_TRUNK}|{_CHINESE_MOBILE})(?!\w|[.,-]?\d)",
    re.ASCII,
)
_PHONE_DIGITS = (8, 15)  # E.164 allows 15 digits; fewer than 8 is an extension, a year range or a count
_DIGIT = re.compile(r"\d", re.ASCII)


def _digits(text: str) -> int:
    return len(_DIGIT.findall(text))


@register
class RedactPII(Transform):
    """E-mail addresses, IP addresses and phone numbers replaced by placeholders, counted per kind."""

    name = "pii"

    def __init__(
        self,
        emails: bool = True,
        ip_addresses: bool = True,
        phone_numbers: bool = True,
        public_ips_only: bool = True,
        email_placeholder: str = "<EMAIL>",
        ip_placeholder: str = "<IP_ADDRESS>",
        phone_placeholder: str = "<PHONE_NUMBER>",
    ):
        super().__init__()
        self.public_ips_only = public_ips_only
        self.placeholders = {
            "email": email_placeholder,
            "ip_address": ip_placeholder,
            "phone_number": phone_placeholder,
        }
        # Addresses first: an e-mail domain or an IP address must not be half-eaten by the phone pattern.
        self.kinds = [kind for kind, on in zip(KINDS, (emails, ip_addresses, phone_numbers)) if on]

    def transform(self, doc: Document) -> Document:
        text = doc.text
        for kind in self.kinds:
            text, replaced = self.redact_kind(kind, text)
            if replaced:
                self.stats.changed[kind] += 1
                self.stats.changed[f"{kind} replacements"] += replaced
        return doc if text == doc.text else replace(doc, text=text)

    def redact(self, text: str) -> str:
        """`text` with every match replaced (for use outside a pipeline)."""
        for kind in self.kinds:
            text, _ = self.redact_kind(kind, text)
        return text

    def redact_kind(self, kind: str, text: str) -> tuple[str, int]:
        """`text` with one kind replaced, and how many matches were."""
        placeholder = self.placeholders[kind]
        if kind == "email":
            return _substitute(_EMAIL, text, _is_email, placeholder) if "@" in text else (text, 0)
        if kind == "ip_address":
            return self._ips(text, placeholder)
        return _substitute(_PHONE, text, _is_phone, placeholder)

    def _ips(self, text: str, placeholder: str) -> tuple[str, int]:
        replaced = 0
        if "." in text:
            text, replaced = _substitute(_IPV4, text, self._is_ipv4, placeholder)
        if "::" in text or text.count(":") >= 7:
            text, more = _substitute(_IPV6, text, self._is_ipv6, placeholder)
            replaced += more
        return text, replaced

    def _is_ipv4(self, match: re.Match) -> bool:
        if _NOT_AN_ADDRESS.search(match.string, max(0, match.start() - 24), match.start()):
            return False
        return self._wanted(match.group(0))

    def _is_ipv6(self, match: re.Match) -> bool:
        return _plausible_ipv6(match.group(0)) and self._wanted(match.group(0))

    def _wanted(self, candidate: str) -> bool:
        try:
            address = ipaddress.ip_address(candidate)
        except ValueError:
            return False
        return address.is_global or not self.public_ips_only


def _substitute(
    pattern: re.Pattern, text: str, wanted: Callable[[re.Match], bool], placeholder: str
) -> tuple[str, int]:
    """`text` with the matches that `wanted` accepts replaced, and how many those were."""
    replaced = 0

    def replace_one(match: re.Match) -> str:
        nonlocal replaced
        if not wanted(match):
            return match.group(0)
        replaced += 1
        return placeholder

    return pattern.sub(replace_one, text), replaced


def _is_email(match: re.Match) -> bool:
    return match.group(1).lower() not in _FILE_SUFFIXES


def _is_phone(match: re.Match) -> bool:
    return _PHONE_DIGITS[0] <= _digits(match.group(0)) <= _PHONE_DIGITS[1]


def _plausible_ipv6(candidate: str) -> bool:
    """Compressed forms need three groups and a digit, so C++'s "std::max" or "a::b" stay."""
    groups = [g for g in candidate.split(":") if g]
    return len(groups) == 8 or (len(groups) >= 3 and any(c.isdigit() for c in candidate))
