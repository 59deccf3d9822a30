//! The HTTP side: the serving port (the inference APIs, the tenant's model list, weir's
//! approvals API, the quota service's endpoint), the admin port, and the listeners they are
//! served on.

pub mod approvals;
pub mod listener;
pub mod quota;
pub mod runs;
pub mod server;
