"""PII masking: e-mail addresses, IP addresses and phone numbers become placeholders, counted."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from marinlm.data.steps import Transform

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24}\b")
# Dotted quads not glued to other digits or dots (so version strings like 1.2.3.4.5 stay).
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){2,7}[0-9A-Fa-f]{1,4}(?![\w:])")
# +country (area) exchange-line with separators; needs separators so plain numbers are untouched.
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w-])")


@dataclass(kw_only=True)
class PIIConfig:
    enabled: bool = True
    email: bool = True
    ip: bool = True
    phone: bool = True
    email_placeholder: str = "<EMAIL>"
    ip_placeholder: str = "<IP_ADDRESS>"
    phone_placeholder: str = "<PHONE_NUMBER>"


def _valid_ip(text: str) -> bool:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    # 0.0.0.0, localhost and documentation examples are not anyone's personal data.
    return not (address.is_unspecified or address.is_loopback)


class MaskPII(Transform):
    name = "pii"

    def __init__(self, config: PIIConfig):
        self.config = config

    def apply(self, doc, ctx):
        c, counters = self.config, ctx.stats[self.name].counters
        text = doc.text
        if c.email:
            text, n = EMAIL.subn(c.email_placeholder, text)
            counters["email"] += n
        if c.ip:

            def ip_sub(match):
                if _valid_ip(match.group()):
                    counters["ip_address"] += 1
                    return c.ip_placeholder
                return match.group()

            text = IPV4.sub(ip_sub, text)
            text = IPV6.sub(ip_sub, text)
        if c.phone:
            text, n = PHONE.subn(c.phone_placeholder, text)
            counters["phone_number"] += n
        return text
