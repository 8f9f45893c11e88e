"""Transport security and credentials: TLS for every gRPC channel (``tls``), the deployment CA
behind ``tally certs`` (``certs``), coordinator-issued device tokens and session tickets
(``tokens``). Everything that fails authentication raises ``AuthError``, which names its gRPC
status."""

from tally.security.errors import AuthError
from tally.security.tls import (
    TLSConfig,
    bind,
    channel_credentials,
    channel_options,
    is_loopback_host,
    open_channel,
    server_credentials,
)
from tally.security.tokens import (
    DeviceClaims,
    OwnerTokens,
    SessionTicket,
    TicketSigner,
    TicketVerifier,
    TokenIssuer,
    bearer_metadata,
    config_digest,
    load_or_create_ticket_key,
    load_or_create_token_secret,
    load_ticket_public_key,
    owner_metadata,
    owner_token_from_metadata,
    token_from_metadata,
)

__all__ = [
    "AuthError",
    "DeviceClaims",
    "OwnerTokens",
    "SessionTicket",
    "TLSConfig",
    "TicketSigner",
    "TicketVerifier",
    "TokenIssuer",
    "bearer_metadata",
    "bind",
    "channel_credentials",
    "channel_options",
    "config_digest",
    "is_loopback_host",
    "load_or_create_ticket_key",
    "load_or_create_token_secret",
    "load_ticket_public_key",
    "open_channel",
    "owner_metadata",
    "owner_token_from_metadata",
    "server_credentials",
    "token_from_metadata",
]
