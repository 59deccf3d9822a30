//! Why a tool call, or a tool offered, does not reach its destination, and the error that says
//! so in the called API's shape (a local reply, or a stream's last event).

use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// The `policy` a `tool_blocked` error names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The key's tool policy blocks the tool (or lists allowed tools without it).
    Blocked,
    /// The model called a tool the request did not offer: a name the client would run
    /// unchecked, so it fails closed.
    NotOffered,
    /// A piece of the call's name came after the call was decided.
    Renamed,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Blocked => "blocked",
            Policy::NotOffered => "not_offered",
            Policy::Renamed => "renamed",
        }
    }
}

/// A call the client does not receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Withheld {
    Blocked {
        tool: String,
        policy: Policy,
    },
    /// A call to an `approval` tool, held for an approver.
    Approval {
        approval_id: String,
        tool: String,
        /// Hex SHA-256 of the arguments as the client would have assembled them.
        arguments_sha256: String,
        run_id: Option<String>,
    },
    /// The call's events could not be held to be judged ([`super::MAX_HELD_BYTES`]).
    TooLarge {
        tool: String,
    },
    /// The answer could not be read for its calls (an event not of its API's shape, one too
    /// large to hold, a compressed body).
    Unreadable,
}

impl Withheld {
    /// The error the client gets in place of the call.
    pub fn error(&self) -> ApiError {
        match self {
            Withheld::Blocked { tool, policy } => tool_blocked(tool, *policy),
            Withheld::Approval {
                approval_id,
                tool,
                arguments_sha256,
                run_id,
            } => {
                let error = ApiError::new(
                    403,
                    format!(
                        "the call to `{tool}` needs an approver's approval: it is held as \
                         {approval_id}; once approved, send the request again with \
                         weir-approval-id: {approval_id}"
                    ),
                )
                .with_type("approval_required")
                .with_code("approval_required")
                .with_extra("approval_id", approval_id.clone())
                .with_extra("tool", tool.clone())
                .with_extra("arguments_sha256", arguments_sha256.clone());
                match run_id {
                    Some(run) => error.with_extra("run_id", run.clone()),
                    None => error,
                }
            }
            Withheld::TooLarge { tool } => ApiError::new(
                403,
                format!("the call to `{tool}` was too large to be checked against the tool policy"),
            )
            .with_type("tool_blocked")
            .with_code("tool_call_too_large")
            .with_extra("tool", tool.clone()),
            Withheld::Unreadable => ApiError::new(
                403,
                "the answer could not be read to check its tool calls against the tool policy",
            )
            .with_type("tool_blocked")
            .with_code("tool_call_unreadable"),
        }
    }
}

/// 403 `tool_blocked`, naming the tool and the policy.
pub fn tool_blocked(tool: &str, policy: Policy) -> ApiError {
    let why = match policy {
        Policy::Blocked => "is blocked by this key's tool policy",
        Policy::NotOffered => "was called but not offered in the request",
        Policy::Renamed => "changed its name after it was checked",
    };
    ApiError::new(403, format!("the tool `{tool}` {why}"))
        .with_type("tool_blocked")
        .with_code("tool_blocked")
        .with_extra("tool", tool.to_owned())
        .with_extra("policy", policy.name())
}

/// Hex SHA-256 of a call's arguments: what an approver approves, bound to the approval.
pub fn arguments_sha256(arguments: &str) -> String {
    Sha256::digest(arguments.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
