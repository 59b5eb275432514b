"""One error hierarchy.  The CLI prints `watcher: <message>` on one line and
exits with the error's code; nothing else reaches the user as a traceback."""


class WatcherError(Exception):
    exit_code = 1


class UsageError(WatcherError):
    """A bad option or option combination."""
    exit_code = 2


class TargetError(WatcherError):
    """The pid does not exist, or exited while attaching."""
    exit_code = 3


class PermissionProblem(WatcherError):
    """Not enough privilege to load BPF programs."""
    exit_code = 4


class EnvironmentProblem(WatcherError):
    """bcc, kernel headers, BTF or tracefs missing."""
    exit_code = 5


class RecordingError(WatcherError):
    """A recording that is missing, corrupt, truncated or of an unknown version."""
    exit_code = 6


class QueryError(WatcherError):
    """A SQL error."""
    exit_code = 7


class NodeUnusable(WatcherError):
    """The node's health breaker tripped (watcher/health.py): no job should launch here."""
    exit_code = 8
