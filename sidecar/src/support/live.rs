//! A value read by request handlers and replaced whole by reloads.

use std::sync::{Arc, RwLock};

/// A value read by request handlers and replaced by reloads.
#[derive(Debug)]
pub struct Live<T>(RwLock<Arc<T>>);

impl<T> Live<T> {
    pub fn new(value: T) -> Live<T> {
        Live(RwLock::new(Arc::new(value)))
    }

    pub fn load(&self) -> Arc<T> {
        match self.0.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn store(&self, value: T) {
        let value = Arc::new(value);
        match self.0.write() {
            Ok(mut v) => *v = value,
            Err(poisoned) => *poisoned.into_inner() = value,
        }
    }
}
