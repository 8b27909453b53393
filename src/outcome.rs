//! The one label a metric (and a log line's `outcome`) gives a call that ended: each error
//! type says whether it ran out of time ([`Timed`]), and [`CallOutcome`] maps that (or an
//! outer deadline that passed) to its label, so no call site decides it.

/// How a call ended, as a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallOutcome {
    /// It succeeded: `ok`.
    Ok,
    /// It ran out of time (the client's timeout or the loop's outer deadline): `timeout`.
    Timeout,
    /// Anything else that failed (refused, reset, a status, a wrong answer): `error`.
    Error,
}

impl CallOutcome {
    /// The metric label: `ok`, `timeout`, `error`.
    pub(crate) const fn label(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Timeout => "timeout",
            CallOutcome::Error => "error",
        }
    }

    /// The outcome of a failure `e`.
    pub(crate) fn of_error(e: &impl Timed) -> Self {
        if e.is_timeout() {
            CallOutcome::Timeout
        } else {
            CallOutcome::Error
        }
    }

    /// The outcome of a call bounded by an outer deadline: `None` when the deadline passed.
    pub(crate) fn of_bounded<T, E: Timed>(result: Option<&Result<T, E>>) -> Self {
        match result {
            Some(Ok(_)) => CallOutcome::Ok,
            Some(Err(e)) => Self::of_error(e),
            None => CallOutcome::Timeout,
        }
    }
}

/// An error that can tell a timeout from any other failure.
pub(crate) trait Timed {
    /// Whether the call ran out of time.
    fn is_timeout(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    struct E(bool);
    impl Timed for E {
        fn is_timeout(&self) -> bool {
            self.0
        }
    }

    #[test]
    fn a_bounded_call_is_ok_timeout_or_error() {
        let label = |r: Option<Result<(), E>>| CallOutcome::of_bounded(r.as_ref()).label();
        assert_eq!(label(Some(Ok(()))), "ok");
        assert_eq!(label(Some(Err(E(true)))), "timeout");
        assert_eq!(label(Some(Err(E(false)))), "error");
        assert_eq!(label(None), "timeout");
    }
}
