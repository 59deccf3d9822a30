//! The HTTP side: the serving port (the inference APIs, the tenant's model list, the quota
//! service's endpoint), the admin port, and the listeners they are served on.

pub mod listener;
pub mod quota;
pub mod runs;
pub mod server;
