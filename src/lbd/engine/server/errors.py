"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``, the HTTP status in ``code``."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into the JSON response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or error_type(status)
        self.close = close  # the connection cannot be reused (e.g. the rest of the body never came)


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or error_type(status), "param": param,
                      "code": status}}


def error_response(err: APIError) -> web.Response:
    body = orjson.dumps(error_body(err.message, err.status, err.param, err.err_type))
    resp = web.Response(body=body, status=err.status, content_type="application/json")
    if err.close:
        resp.force_close()
    return resp


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)
