"""The error codes of meshrun/error.h and the exception every failing call raises."""

# Error codes (meshrun/error.h).
INVALID_ARGUMENT = 1
NOT_FOUND = 2
FAILED_PRECONDITION = 3
OUT_OF_RANGE = 4
UNIMPLEMENTED = 5
VERSION_MISMATCH = 6
INTERNAL = 7
UNAVAILABLE = 8
DEADLINE_EXCEEDED = 9

CODE_NAMES = {
    INVALID_ARGUMENT: "INVALID_ARGUMENT", NOT_FOUND: "NOT_FOUND",
    FAILED_PRECONDITION: "FAILED_PRECONDITION", OUT_OF_RANGE: "OUT_OF_RANGE",
    UNIMPLEMENTED: "UNIMPLEMENTED", VERSION_MISMATCH: "VERSION_MISMATCH", INTERNAL: "INTERNAL",
    UNAVAILABLE: "UNAVAILABLE", DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
}


class MeshrunError(Exception):
    """A failed meshrun call: `code` is one of the MESHRUN_* codes
    (meshrun.INVALID_ARGUMENT, ...), `message` the library's message."""

    def __init__(self, code, message):
        super().__init__(f"{CODE_NAMES.get(code, code)}: {message}")
        self.code = code
        self.message = message
