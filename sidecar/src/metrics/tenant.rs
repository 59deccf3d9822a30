//! The tenant dimension of metrics: a tenant's path cut to a configured depth (org, workspace
//! or project), never down to the key (keys are always a path's fourth level). Series then
//! grow with the orgs (or workspaces, or projects) a deployment has, which the operator
//! chooses, not with the keys its users mint; and no label names a key.

use crate::config::metrics::TenantDepth;

impl TenantDepth {
    fn levels(self) -> usize {
        match self {
            TenantDepth::Org => 1,
            TenantDepth::Workspace => 2,
            TenantDepth::Project => 3,
        }
    }

    /// The label for `tenant` (a key's `org/workspace/project/key`, or a level's path such as a
    /// quota counter's `acme/search`): its first levels, at most three, so never a key.
    pub fn label(self, tenant: &str) -> &str {
        match tenant.match_indices('/').nth(self.levels() - 1) {
            Some((end, _)) => &tenant[..end],
            None => tenant,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stop_above_the_key_at_the_configured_depth() {
        let key = "acme/search/ranking/prod-key";
        assert_eq!(TenantDepth::Org.label(key), "acme");
        assert_eq!(TenantDepth::Workspace.label(key), "acme/search");
        assert_eq!(TenantDepth::Project.label(key), "acme/search/ranking");
        // A level's own path (a workspace's quota counter) is labelled as its keys are.
        assert_eq!(TenantDepth::Workspace.label("acme/search"), "acme/search");
        assert_eq!(TenantDepth::Project.label("acme/search"), "acme/search");
        // The default tenant names no key.
        assert_eq!(TenantDepth::Project.label("anonymous"), "anonymous");
    }
}
