"""The landing-zone sources and their record schemas (the contract the generator writes)."""

from __future__ import annotations

from ..declaration import Field, Source

_ID = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"

PAYMENTS = Source(
    name="payments",
    fields=(
        Field("event_id", "string", pattern=_ID),
        Field("event_time", "timestamp"),
        Field("card_id", "string", pattern=_ID),
        Field("user_id", "string", pattern=_ID),
        Field("merchant_id", "string", pattern=_ID),
        Field("amount", "decimal"),
        Field("currency", "string", pattern=r"^[A-Z]{3}$"),
        Field("status", "enum", choices=("APPROVED", "DECLINED")),
    ),
)

LOGINS = Source(
    name="logins",
    fields=(
        Field("event_id", "string", pattern=_ID),
        Field("event_time", "timestamp"),
        Field("user_id", "string", pattern=_ID),
        Field("status", "enum", choices=("SUCCESS", "FAILED")),
        Field("ip", "ip"),
    ),
)

SOURCES = {s.name: s for s in (PAYMENTS, LOGINS)}
