"""Errors in the OpenAI API's shape: {"error": {message, type, param, code}}."""

from typing import Dict, Optional, Union

from pydantic import BaseModel, ValidationError


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None) -> dict:
    """The JSON body of an error response: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class ProtocolError(ValueError):
    """A request the API rejects; `body()` is the JSON to send with `status`."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                 status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    @classmethod
    def from_validation(cls, e: ValidationError, rename: Optional[Dict[str, str]] = None) -> "ProtocolError":
        """Readable message ("top_p: Input should be greater than 0"); `rename` maps the
        first path element (an engine field) to the request field it came from."""
        msgs, params = [], []
        for err in e.errors(include_url=False):
            loc = list(err["loc"])
            if loc and rename:
                loc[0] = rename.get(loc[0], loc[0])
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")  # messages[0].role
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{where}: {msg}" if where else msg)
            params.append(where)
        return cls("; ".join(dict.fromkeys(msgs)), param=next((p for p in params if p), None))


def parse_request(cls: type, data: Union[dict, str, bytes]):
    """`cls` (a request model) from a JSON body or dict; `ProtocolError` if invalid."""
    try:
        return cls.model_validate_json(data) if isinstance(data, (str, bytes)) else cls.model_validate(data)
    except ValidationError as e:
        raise ProtocolError.from_validation(e) from None
